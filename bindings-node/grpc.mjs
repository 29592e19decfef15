// The ES module entry of oncely/grpc: the same function as the CommonJS one.
import { createRequire } from 'node:module'

const require = createRequire(import.meta.url)
export const { withIdempotency } = require('./grpc.js')
