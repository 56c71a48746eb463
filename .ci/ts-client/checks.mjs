// The official Durable Streams TypeScript client (@durable-streams/client) against a server.
//
//   node checks.mjs http://127.0.0.1:PORT
//
// Runs named checks across the client's API (create, append, the idempotent producer, catch-up,
// long-poll and SSE reads, close, HEAD, delete, errors) and prints one line per check:
//   PASS <name>
//   FAIL <name>: <what was expected and what came>
// then "SUMMARY passed=<n> failed=<m>". Exits 1 when a check failed or a scenario broke off.
// Each wait is bounded (WAIT_MS); nothing asserts on timing.

import {
  DurableStream,
  IdempotentProducer,
  StaleEpochError,
  StreamClosedError,
  stream,
} from "@durable-streams/client";

const BASE = process.argv[2];
if (!BASE) {
  console.error("usage: node checks.mjs <server base url>");
  process.exit(2);
}
const WAIT_MS = 30_000;
const RUN = Math.random().toString(36).slice(2, 8);
const results = [];

function url(name) {
  return `${BASE}/v1/stream/ts-${RUN}/${name}`;
}

function show(value) {
  if (value instanceof Uint8Array) return `bytes[${Array.from(value).join(",")}]`;
  try {
    return JSON.stringify(value);
  } catch {
    return String(value);
  }
}

function ok(name, cond, detail = "") {
  results.push({ name, pass: Boolean(cond), detail });
  console.log(cond ? `PASS ${name}` : `FAIL ${name}: ${detail}`);
}

function eq(name, actual, expected) {
  const a = show(actual);
  const e = show(expected);
  ok(name, a === e, `expected ${e}, got ${a}`);
}

// The error a promise rejects with (or a note that it did not reject).
async function rejection(promise) {
  try {
    await promise;
  } catch (err) {
    return err;
  }
  return new Error("(did not reject)");
}

function within(promise, what) {
  let timer;
  const timeout = new Promise((_, reject) => {
    timer = setTimeout(() => reject(new Error(`gave up waiting for ${what} after ${WAIT_MS} ms`)), WAIT_MS);
  });
  return Promise.race([promise, timeout]).finally(() => clearTimeout(timer));
}

// This client version reports most refusals as a FetchError (status, lower-case headers, parsed
// JSON body) thrown by its retrying fetch, before its own DurableStreamError mapping runs; both
// carry the status, and a FetchError also the response headers.
function status(err) {
  return err?.status;
}

function header(err, name) {
  if (err instanceof StreamClosedError && name === "stream-next-offset") return err.finalOffset;
  if (err instanceof StreamClosedError && name === "stream-closed") return "true";
  return err?.headers?.[name];
}

function describe(err) {
  return `${err?.name} status=${err?.status} code=${err?.code ?? err?.json?.error?.code} ${err?.message ?? ""}`.slice(0, 300);
}

async function scenario(title, fn) {
  try {
    await fn();
  } catch (err) {
    ok(`${title}: ran to the end`, false, `threw ${err?.name}: ${err?.message}`);
  }
}

async function rawHead(u) {
  return fetch(u, { method: "HEAD" });
}

async function tail(u) {
  return (await DurableStream.head({ url: u })).offset;
}

async function readAll(u, opts = {}) {
  const res = await stream({ url: u, live: false, ...opts });
  return res;
}

function bytes(...values) {
  return new Uint8Array(values);
}

function concat(...parts) {
  const out = new Uint8Array(parts.reduce((n, p) => n + p.length, 0));
  let at = 0;
  for (const p of parts) {
    out.set(p, at);
    at += p.length;
  }
  return out;
}

// Collects a live session's batches until `done(state)` holds; returns the state.
async function collect(res, kind, done, what) {
  const state = { items: [], data: new Uint8Array(0), text: "", batches: [] };
  let finish;
  const finished = new Promise((resolve) => (finish = resolve));
  const onBatch = async (batch) => {
    state.batches.push({ offset: batch.offset, upToDate: batch.upToDate, streamClosed: batch.streamClosed });
    if (kind === "json") state.items.push(...batch.items);
    if (kind === "bytes") state.data = concat(state.data, batch.data);
    if (kind === "text") state.text += batch.text;
    if (done(state, batch)) finish();
  };
  const unsubscribe =
    kind === "json" ? res.subscribeJson(onBatch) : kind === "bytes" ? res.subscribeBytes(onBatch) : res.subscribeText(onBatch);
  try {
    await within(Promise.race([finished, res.closed.then(() => finish())]), what);
  } finally {
    unsubscribe();
  }
  return state;
}

// ------------------------------------------------------------------------------------ create

await scenario("create", async () => {
  const u = url("create/json");
  const h = await DurableStream.create({ url: u, contentType: "application/json", ttlSeconds: 3600 });
  eq("create: handle remembers the content type", h.contentType, "application/json");
  const head = await h.head();
  eq("create: HEAD says it exists", head.exists, true);
  eq("create: HEAD content type", head.contentType, "application/json");
  ok("create: HEAD has an offset", typeof head.offset === "string" && head.offset.length > 0, `offset ${head.offset}`);
  eq("create: HEAD not closed", head.streamClosed, false);
  eq("create: TTL stored (Stream-TTL on HEAD)", (await rawHead(u)).headers.get("stream-ttl"), "3600");
  const again = await rejection(DurableStream.create({ url: u, contentType: "application/json", ttlSeconds: 3600 }));
  eq("create: an identical create is idempotent (no error)", again.message, "(did not reject)");
  const conflict = await rejection(DurableStream.create({ url: u, contentType: "text/plain" }));
  eq("create: another content type at the same URL is a 409", status(conflict), 409);
  ok("create: the 409 says why", conflict?.json?.error?.code === "config_conflict" || conflict?.code === "CONFLICT_EXISTS", describe(conflict));
  const ttlConflict = await rejection(DurableStream.create({ url: u, contentType: "application/json", ttlSeconds: 60 }));
  eq("create: another TTL at the same URL is a 409", status(ttlConflict), 409);

  const expiresAt = new Date(Date.now() + 3_600_000).toISOString();
  const ue = url("create/expires");
  await DurableStream.create({ url: ue, contentType: "text/plain", expiresAt });
  eq("create: Stream-Expires-At stored", (await rawHead(ue)).headers.get("stream-expires-at"), expiresAt);

  const ub = url("create/with-body");
  await DurableStream.create({ url: ub, contentType: "text/plain", body: "initial text" });
  eq("create: an initial body is the first data", await (await readAll(ub)).text(), "initial text");

  const uc = url("create/charset");
  const hc = await DurableStream.create({ url: uc, contentType: "application/json; charset=utf-8" });
  await hc.append(JSON.stringify({ ok: true }));
  eq("create: JSON with a charset parameter is JSON mode", await (await readAll(uc)).json(), [{ ok: true }]);

  const ubin = url("create/binary");
  const hb = await DurableStream.create({ url: ubin, contentType: "application/octet-stream" });
  eq("create: binary content type", (await hb.head()).contentType, "application/octet-stream");

  const empty = url("create/empty");
  await DurableStream.create({ url: empty, contentType: "application/json" });
  const closedEmpty = url("create/closed-empty");
  await DurableStream.create({ url: closedEmpty, contentType: "application/json", closed: true });
  const ce = await DurableStream.head({ url: closedEmpty });
  eq("create closed: HEAD says closed", ce.streamClosed, true);
  eq("create closed without body: its tail is an empty stream's tail", ce.offset, await tail(empty));
  const cer = await readAll(closedEmpty);
  eq("create closed without body: reads as empty", await cer.json(), []);
  eq("create closed without body: the read says closed", cer.streamClosed, true);

  const closedBody = url("create/closed-body");
  await DurableStream.create({ url: closedBody, contentType: "text/plain", body: "all there is", closed: true });
  const cbr = await readAll(closedBody);
  eq("create closed with body: reads the body", await cbr.text(), "all there is");
  eq("create closed with body: the read says closed", cbr.streamClosed, true);
  eq("create closed with body: the read ends at HEAD's offset", cbr.offset, await tail(closedBody));
});

// ------------------------------------------------------------------------------------ append

await scenario("append json", async () => {
  const u = url("append/json");
  const h = await DurableStream.create({ url: u, contentType: "application/json" });
  await h.append(JSON.stringify({ n: 1 }));
  const afterFirst = await tail(u);
  await h.append(JSON.stringify({ n: 2, s: "héllo, \"world\" ✓" }));
  await h.append(JSON.stringify([1, 2]));
  eq("append json: three appends read back in order (an array value stays one message)", await (await readAll(u)).json(), [
    { n: 1 },
    { n: 2, s: "héllo, \"world\" ✓" },
    [1, 2],
  ]);
  await Promise.all(Array.from({ length: 10 }, (_, i) => h.append(JSON.stringify({ batched: i }))));
  const all = await (await readAll(u)).json();
  eq("append json: ten concurrent appends (batched by the client) all arrive", all.length, 13);
  eq("append json: concurrent appends keep their order", all.slice(3).map((x) => x.batched), [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]);
  eq("append json: a read from a saved offset returns what came after", (await (await readAll(u, { offset: afterFirst })).json()).length, 12);
  const bad = await rejection(h.append("{not json"));
  eq("append json: invalid JSON is refused with a 400", status(bad), 400);
  const wrongType = await rejection(h.append("text", { contentType: "text/plain" }));
  eq("append json: a different content type is a 409", status(wrongType), 409);
  eq("append json: nothing of the refused appends was stored", (await (await readAll(u)).json()).length, 13);
});

await scenario("append seq", async () => {
  const u = url("append/seq");
  const h = await DurableStream.create({ url: u, contentType: "text/plain", batching: false });
  await h.append("a", { seq: "0001" });
  await h.append("b", { seq: "0002" });
  const stale = await rejection(h.append("c", { seq: "0002" }));
  eq("append seq: a Stream-Seq not above the last is a 409", status(stale), 409);
  await h.append("d", { seq: "0010" });
  eq("append seq: only the accepted appends are stored", await (await readAll(u)).text(), "abd");
});

await scenario("append bytes", async () => {
  const u = url("append/bytes");
  const h = await DurableStream.create({ url: u, contentType: "application/octet-stream" });
  const first = bytes(0, 1, 2, 255, 10, 13);
  await h.append(first);
  await h.append("abc");
  eq("append bytes: binary and string appends read back byte for byte", await (await readAll(u)).body(), concat(first, new TextEncoder().encode("abc")));
  const ut = url("append/text");
  const ht = await DurableStream.create({ url: ut, contentType: "text/plain" });
  await ht.append("line 1\n");
  await ht.append("línea 2\n");
  eq("append text: text appends concatenate", await (await readAll(ut)).text(), "line 1\nlínea 2\n");
  await ht.appendStream((async function* () {
    yield "streamed ";
    yield "body";
  })());
  eq("append text: appendStream sends the whole source", await (await readAll(ut)).text(), "line 1\nlínea 2\nstreamed body");
});

// ------------------------------------------------------------------------------------ producer

await scenario("producer", async () => {
  const u = url("producer/json");
  const h = await DurableStream.create({ url: u, contentType: "application/json" });
  const errors = [];
  const p = new IdempotentProducer(h, "writer-1", { lingerMs: 1, maxInFlight: 3, onError: (e) => errors.push(e) });
  for (let i = 0; i < 50; i++) p.append(JSON.stringify({ i }));
  await p.flush();
  const got = await (await readAll(u)).json();
  eq("producer: 50 messages, each once", got.length, 50);
  eq("producer: in order", got.map((x) => x.i).join(","), Array.from({ length: 50 }, (_, i) => i).join(","));
  eq("producer: no errors", errors.map((e) => e.message), []);
  eq("producer: lastSuccessfulOffset is the tail", p.lastSuccessfulOffset, await tail(u));
  ok("producer: sequence numbers were used", p.nextSeq > 0, `nextSeq ${p.nextSeq}`);

  await p.restart();
  eq("producer: restart bumps the epoch", p.epoch, 1);
  p.append(JSON.stringify({ after: "restart" }));
  await p.flush();
  eq("producer: appends after a restart arrive", (await (await readAll(u)).json()).at(-1), { after: "restart" });

  const zombieErrors = [];
  const zombie = new IdempotentProducer(h, "writer-1", { epoch: 0, lingerMs: 1, onError: (e) => zombieErrors.push(e) });
  zombie.append(JSON.stringify({ from: "zombie" }));
  await zombie.flush().catch(() => {});
  ok("producer: an older epoch is fenced (StaleEpochError)", zombieErrors.some((e) => e instanceof StaleEpochError), show(zombieErrors.map((e) => e.name)));
  const fenced = zombieErrors.find((e) => e instanceof StaleEpochError);
  eq("producer: the fence names the current epoch", fenced?.currentEpoch, 1);
  ok("producer: nothing of the zombie is stored", !(await (await readAll(u)).json()).some((x) => x?.from === "zombie"), "zombie data found");

  const claimer = new IdempotentProducer(h, "writer-1", { epoch: 0, autoClaim: true, lingerMs: 1 });
  claimer.append(JSON.stringify({ from: "claimer" }));
  await claimer.flush();
  eq("producer: autoClaim takes the next epoch after a 403", claimer.epoch, 2);
  eq("producer: autoClaim's message is stored once", (await (await readAll(u)).json()).filter((x) => x?.from === "claimer").length, 1);
  const oldEpoch = new IdempotentProducer(h, "writer-1", { epoch: 1, lingerMs: 1, onError: () => {} });
  oldEpoch.append(JSON.stringify({ from: "epoch-1-again" }));
  await oldEpoch.flush().catch(() => {});
  ok("producer: the epoch autoClaim replaced is fenced too", !(await (await readAll(u)).json()).some((x) => x?.from === "epoch-1-again"), "stored");

  await claimer.detach();
  eq("producer: detach leaves the stream open", (await h.head()).streamClosed, false);
  const late = await rejection(Promise.resolve().then(() => claimer.append("{}")));
  ok("producer: append after detach throws", late.message !== "(did not reject)", late.message);

  const ub = url("producer/bytes");
  const hb = await DurableStream.create({ url: ub, contentType: "application/octet-stream" });
  const pb = new IdempotentProducer(hb, "bytes-writer", { lingerMs: 1 });
  pb.append(bytes(1, 2, 3));
  pb.append("xyz");
  await pb.flush();
  eq("producer: byte stream data concatenates", await (await readAll(ub)).body(), concat(bytes(1, 2, 3), new TextEncoder().encode("xyz")));
  await pb.detach();
});

// ------------------------------------------------------------------------------------ catch-up reads

await scenario("catch-up", async () => {
  const u = url("read/catch-up");
  const h = await DurableStream.create({ url: u, contentType: "application/json" });
  for (let i = 0; i < 5; i++) await h.append(JSON.stringify({ i }));
  const end = await tail(u);
  const res = await readAll(u);
  eq("catch-up: json() returns every message", (await res.json()).map((x) => x.i), [0, 1, 2, 3, 4]);
  eq("catch-up: ends up to date", res.upToDate, true);
  eq("catch-up: ends at HEAD's offset", res.offset, end);
  eq("catch-up: an open stream is not closed", res.streamClosed, false);
  const explicit = await readAll(u, { offset: "-1" });
  eq("catch-up: offset -1 is the start", (await explicit.json()).length, 5);
  const now = await readAll(u, { offset: "now" });
  eq("catch-up: offset now returns nothing", await now.json(), []);
  eq("catch-up: offset now is at the tail", now.offset, end);
  const atEnd = await readAll(u, { offset: end });
  eq("catch-up: a read at the tail returns nothing", await atEnd.json(), []);
  eq("catch-up: a read at the tail stays there", atEnd.offset, end);
  const items = [];
  for await (const item of (await readAll(u)).jsonStream()) items.push(item.i);
  eq("catch-up: jsonStream() yields each message", items, [0, 1, 2, 3, 4]);
  const batches = [];
  const sub = await readAll(u);
  await within(
    new Promise((resolve) => {
      sub.subscribeJson((b) => {
        batches.push(b);
        if (b.upToDate) resolve();
      });
    }),
    "subscribeJson to reach upToDate",
  );
  eq("catch-up: subscribeJson's batches hold every message", batches.flatMap((b) => b.items).length, 5);
  eq("catch-up: subscribeJson's last batch is at the tail", batches.at(-1).offset, end);

  const ub = url("read/binary");
  const hb = await DurableStream.create({ url: ub, contentType: "application/octet-stream" });
  const all = new Uint8Array(256).map((_, i) => i);
  await hb.append(all);
  eq("catch-up: every byte value survives a binary read", await (await readAll(ub)).body(), all);
  const text = [];
  for await (const chunk of (await readAll(url("create/with-body"))).textStream()) text.push(chunk);
  eq("catch-up: textStream() yields the text", text.join(""), "initial text");
});

// ------------------------------------------------------------------------------------ long-poll

await scenario("long-poll", async () => {
  const u = url("live/long-poll");
  const h = await DurableStream.create({ url: u, contentType: "application/json" });
  await h.append(JSON.stringify({ before: true }));
  const start = await tail(u);
  const res = await stream({ url: u, offset: start, live: "long-poll" });
  eq("long-poll: the session reports its mode", res.live, "long-poll");
  const got = collect(res, "json", (s) => s.items.length >= 3, "three long-polled messages");
  for (let i = 0; i < 3; i++) await h.append(JSON.stringify({ live: i }));
  const state = await got;
  eq("long-poll: live appends arrive in order", state.items, [{ live: 0 }, { live: 1 }, { live: 2 }]);
  eq("long-poll: the session's offset reaches the tail", state.batches.at(-1).offset, await tail(u));
  res.cancel();

  const res2 = await stream({ url: u, offset: await tail(u), live: "long-poll" });
  const ended = collect(res2, "json", (s, b) => b.streamClosed, "the long-poll to see the close");
  const { finalOffset } = await h.close();
  const s2 = await ended;
  await within(res2.closed, "the long-poll session to end after the close");
  eq("long-poll: a close ends the session with streamClosed", res2.streamClosed, true);
  eq("long-poll: the session ends at the close's final offset", res2.offset, finalOffset);
  eq("long-poll: the close brings no data", s2.items, []);

  const ub = url("live/long-poll-binary");
  const hb = await DurableStream.create({ url: ub, contentType: "application/octet-stream" });
  const resb = await stream({ url: ub, offset: "-1", live: "long-poll" });
  const gotb = collect(resb, "bytes", (s) => s.data.length >= 4, "binary long-poll data");
  await hb.append(bytes(9, 8, 7, 0));
  eq("long-poll: binary data arrives as sent", (await gotb).data, bytes(9, 8, 7, 0));
  resb.cancel();
});

// ------------------------------------------------------------------------------------ SSE

await scenario("sse", async () => {
  const u = url("live/sse-json");
  const h = await DurableStream.create({ url: u, contentType: "application/json" });
  await h.append(JSON.stringify({ n: 0 }));
  const res = await stream({ url: u, offset: "-1", live: "sse" });
  eq("sse json: the session reports its mode", res.live, "sse");
  const got = collect(res, "json", (s, b) => b.streamClosed, "the SSE session to see the close");
  await h.append(JSON.stringify({ n: 1 }));
  await h.append(JSON.stringify({ n: 2 }));
  await h.append(JSON.stringify([{ n: 3 }]));
  const { finalOffset } = await h.close();
  const state = await got;
  eq("sse json: catch-up and live messages arrive once, in order", state.items, [{ n: 0 }, { n: 1 }, { n: 2 }, [{ n: 3 }]]);
  await within(res.closed, "the SSE session to end after the close");
  eq("sse json: the close ends the session with streamClosed", res.streamClosed, true);
  eq("sse json: the session ends at the close's final offset", res.offset, finalOffset);

  const ub = url("live/sse-binary");
  const hb = await DurableStream.create({ url: ub, contentType: "application/octet-stream" });
  const everyByte = new Uint8Array(256).map((_, i) => 255 - i);
  await hb.append(everyByte.slice(0, 100));
  const resb = await stream({ url: ub, offset: "-1", live: "sse" });
  const gotb = collect(resb, "bytes", (s, b) => b.streamClosed, "binary SSE to see the close");
  await hb.append(everyByte.slice(100));
  const closedB = await hb.close();
  const sb = await gotb;
  // (the client decodes only when the SSE response declares Stream-SSE-Data-Encoding: base64)
  eq("sse binary: every byte value arrives, decoded from base64", sb.data, everyByte);
  await within(resb.closed, "the binary SSE session to end");
  eq("sse binary: ends at the final offset", resb.offset, closedB.finalOffset);

  const ut = url("live/sse-text");
  const ht = await DurableStream.create({ url: ut, contentType: "text/plain" });
  const rest = await stream({ url: ut, offset: "-1", live: "sse" });
  const gott = collect(rest, "text", (s) => s.text.length >= 11, "text SSE data");
  await ht.append("multi\nline\n");
  eq("sse text: text with newlines arrives intact", (await gott).text, "multi\nline\n");
  rest.cancel();

  const ua = url("live/auto");
  const ha = await DurableStream.create({ url: ua, contentType: "application/json" });
  const resa = await stream({ url: ua, offset: "-1", live: true });
  const gota = collect(resa, "json", (s) => s.items.length >= 2, "live:true data");
  await ha.append(JSON.stringify("a"));
  await ha.append(JSON.stringify("b"));
  eq("live auto: live:true delivers appends", (await gota).items, ["a", "b"]);
  resa.cancel();
});

// ------------------------------------------------------------------------------------ close (5.3)

await scenario("close", async () => {
  const u = url("close/json");
  const h = await DurableStream.create({ url: u, contentType: "application/json" });
  await h.append(JSON.stringify({ n: 1 }));
  const before = await tail(u);
  const closed = await h.close();
  eq("close: a close without body leaves the tail unchanged (PROTOCOL.md 5.3)", closed.finalOffset, before);
  const head = await h.head();
  eq("close: HEAD says closed", head.streamClosed, true);
  eq("close: HEAD's offset is unchanged", head.offset, before);
  const again = await h.close();
  eq("close: closing again is idempotent, same final offset", again.finalOffset, before);
  const refused = await rejection(h.append(JSON.stringify({ n: 2 })));
  eq("close: an append after the close is a 409", status(refused), 409);
  eq("close: the 409 says Stream-Closed", header(refused, "stream-closed"), "true");
  eq("close: the 409 carries the final offset", header(refused, "stream-next-offset"), before);
  const res = await readAll(u);
  eq("close: the data stays readable", await res.json(), [{ n: 1 }]);
  eq("close: a catch-up read says closed", res.streamClosed, true);
  eq("close: a catch-up read ends at the final offset", res.offset, before);
  const atOld = await readAll(u, { offset: before });
  eq("close: a read at the old tail returns nothing", await atOld.json(), []);
  eq("close: a read at the old tail says closed", atOld.streamClosed, true);
  eq("close: a read at the old tail stays there", atOld.offset, before);
  const lp = await stream({ url: u, offset: before, live: "long-poll" });
  await within(lp.closed, "a long-poll at the final offset of a closed stream to end");
  eq("close: a long-poll at the final offset ends at once, closed", [lp.streamClosed, lp.offset], [true, before]);
  const sse = await stream({ url: u, offset: before, live: "sse" });
  await within(sse.closed, "an SSE read at the final offset of a closed stream to end");
  eq("close: an SSE read at the final offset ends, closed", [sse.streamClosed, sse.offset], [true, before]);

  const ub = url("close/with-body");
  const hb = await DurableStream.create({ url: ub, contentType: "application/json" });
  await hb.append(JSON.stringify({ n: 1 }));
  const beforeB = await tail(ub);
  const final = await hb.close({ body: JSON.stringify({ last: true }) });
  ok("close with body: the final message moves the tail", final.finalOffset !== beforeB, `final ${final.finalOffset}`);
  eq("close with body: HEAD's offset is the final offset", await tail(ub), final.finalOffset);
  eq("close with body: the final message is the last one", await (await readAll(ub)).json(), [{ n: 1 }, { last: true }]);
  const twice = await rejection(hb.close({ body: JSON.stringify({ last: "again" }) }));
  eq("close with body: again is a 409 (not idempotent without producer headers)", [status(twice), header(twice, "stream-closed")], [409, "true"]);
  eq("close with body: the 409's final offset is unchanged", header(twice, "stream-next-offset"), final.finalOffset);

  const ue = url("close/empty");
  const he = await DurableStream.create({ url: ue, contentType: "text/plain" });
  const emptyTail = await tail(ue);
  eq("close empty: the final offset is the initial tail", (await he.close()).finalOffset, emptyTail);
  eq("close empty: reads as empty and closed", [await (await readAll(ue)).text(), (await he.head()).streamClosed], ["", true]);

  const up = url("close/producer");
  const hp = await DurableStream.create({ url: up, contentType: "application/json" });
  const p = new IdempotentProducer(hp, "closer", { lingerMs: 1 });
  p.append(JSON.stringify({ n: 1 }));
  await p.flush();
  const beforeP = await tail(up);
  const pc = await p.close();
  eq("producer close: without a final message the tail is unchanged", pc.finalOffset, beforeP);
  eq("producer close: HEAD agrees", (await hp.head()).offset, beforeP);
  eq("producer close: calling it again returns the same result", (await p.close()).finalOffset, beforeP);
  // a retry of the close request (same producer id, epoch, sequence) after a lost answer
  const r = await fetch(up, {
    method: "POST",
    headers: { "content-type": "application/json", "producer-id": "closer", "producer-epoch": "0", "producer-seq": String(p.nextSeq - 1), "stream-closed": "true" },
  });
  eq("producer close: a retried close is a 204 duplicate", r.status, 204);
  eq("producer close: the retry reports the same final offset", r.headers.get("stream-next-offset"), beforeP);

  const upf = url("close/producer-final");
  const hpf = await DurableStream.create({ url: upf, contentType: "application/json" });
  const pf = new IdempotentProducer(hpf, "closer", { lingerMs: 1 });
  pf.append(JSON.stringify({ n: 1 }));
  const pfc = await pf.close(JSON.stringify({ bye: true }));
  eq("producer close: a final message is appended with the close", await (await readAll(upf)).json(), [{ n: 1 }, { bye: true }]);
  eq("producer close: with a final message the final offset is the new tail", (await hpf.head()).offset, pfc.finalOffset);

  const ubin = url("close/binary");
  const hbin = await DurableStream.create({ url: ubin, contentType: "application/octet-stream" });
  await hbin.append(bytes(1, 2, 3));
  const beforeBin = await tail(ubin);
  eq("close binary: the tail is unchanged", (await hbin.close()).finalOffset, beforeBin);
});

// ------------------------------------------------------------------------------------ HEAD / metadata

await scenario("head", async () => {
  const u = url("head/stream");
  const h = await DurableStream.create({ url: u, contentType: "application/json" });
  const t0 = (await h.head()).offset;
  await h.append(JSON.stringify({ x: 1 }));
  const head = await h.head();
  ok("head: the offset advances with an append", head.offset !== t0 && head.offset > t0, `${t0} -> ${head.offset}`);
  ok("head: an ETag is sent", typeof head.etag === "string" && head.etag.length > 0, `etag ${head.etag}`);
  eq("head: HEAD is not cached", head.cacheControl, "no-store");
  const connected = await DurableStream.connect({ url: u });
  eq("head: connect() learns the content type", connected.contentType, "application/json");
  eq("head: a missing stream is exists:false", (await DurableStream.head({ url: url("head/missing") })).exists, false);
  const missing = await rejection(new DurableStream({ url: url("head/missing") }).append("x"));
  eq("head: a missing stream is a 404 to an append", status(missing), 404);
});

// ------------------------------------------------------------------------------------ delete

await scenario("delete", async () => {
  const u = url("delete/stream");
  const h = await DurableStream.create({ url: u, contentType: "text/plain", body: "bye" });
  await h.delete();
  eq("delete: HEAD afterwards says exists:false", (await h.head()).exists, false);
  const read = await rejection(stream({ url: u, live: false }));
  eq("delete: reading it fails with a 404", status(read), 404);
  const twice = await rejection(h.delete());
  eq("delete: deleting again is a 404", status(twice), 404);
  const append = await rejection(h.append("x"));
  eq("delete: appending to it is a 404", status(append), 404);
  const u2 = url("delete/static");
  await DurableStream.create({ url: u2, contentType: "text/plain" });
  await DurableStream.delete({ url: u2 });
  eq("delete: DurableStream.delete works too", (await DurableStream.head({ url: u2 })).exists, false);
});

// ------------------------------------------------------------------------------------ errors

await scenario("errors", async () => {
  const missing = new DurableStream({ url: url("errors/missing"), contentType: "text/plain" });
  const append = await rejection(missing.append("x"));
  eq("errors: append to a missing stream is a 404", status(append), 404);
  eq("errors: the 404 has a JSON error body", append?.json?.error?.code ?? append?.code, append?.json ? "not_found" : "NOT_FOUND");
  const close = await rejection(missing.close());
  eq("errors: closing a missing stream is a 404", status(close), 404);
  const read = await rejection(stream({ url: url("errors/missing"), live: false }));
  eq("errors: reading a missing stream fails with a 404", status(read), 404);
  const u = url("errors/stream");
  await DurableStream.create({ url: u, contentType: "application/json", body: JSON.stringify([{ a: 1 }]) });
  const garbage = await rejection(stream({ url: u, offset: "not-an-offset", live: false }));
  eq("errors: a malformed offset fails with a 400", status(garbage), 400);
  const beyond = await rejection(stream({ url: u, offset: "9999999999999999_9999999999999999", live: false }));
  eq("errors: an offset beyond the tail fails with a 400", status(beyond), 400);
  const notJson = await rejection(new DurableStream({ url: u, contentType: "application/json", batching: false }).append("{\"a\": NaN}"));
  eq("errors: NaN is not JSON: a 400", status(notJson), 400);
  eq("errors: the stream is unchanged by the refused requests", await (await readAll(u)).json(), [{ a: 1 }]);
});

// ------------------------------------------------------------------------------------ summary

const failed = results.filter((r) => !r.pass).length;
console.log(`SUMMARY passed=${results.length - failed} failed=${failed}`);
process.exit(failed ? 1 : 0);
