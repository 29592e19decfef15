// The ES module entry of oncely/fetch: the same function as the CommonJS one.
import { createRequire } from 'node:module'

const require = createRequire(import.meta.url)
export const { idempotentFetch, ResponseError } = require('./fetch.js')
