// The Durable Streams server conformance suite, pointed at a running onceflow server.
import { runConformanceTests } from "@durable-streams/server-conformance-tests"

runConformanceTests({
  baseUrl: process.env.CONFORMANCE_BASE_URL ?? "http://127.0.0.1:4437",
  longPollTimeoutMs: Number(process.env.CONFORMANCE_LONG_POLL_MS ?? 500),
  // the reserved __ds subscription APIs (PROTOCOL.md sections 6-7); the suite starts its own
  // webhook receivers on 127.0.0.1, which onceflow accepts as development webhook URLs
  subscriptions: process.env.CONFORMANCE_SUBSCRIPTIONS !== "0",
})
