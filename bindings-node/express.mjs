// The ES module entry of oncely/express: the same function as the CommonJS one.
import { createRequire } from 'node:module'

const require = createRequire(import.meta.url)
export const { idempotency } = require('./express.js')
