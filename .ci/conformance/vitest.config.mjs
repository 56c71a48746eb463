export default { test: { include: ["conformance.test.mjs"], testTimeout: 30000, hookTimeout: 30000 } }
