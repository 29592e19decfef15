// The ES module entry of oncely/fastify: the same plugin as the CommonJS one.
import { createRequire } from 'node:module'

const require = createRequire(import.meta.url)
export const { idempotency } = require('./fastify.js')
export default idempotency
