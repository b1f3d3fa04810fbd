-- wrk script: POST a body with an Idempotency-Key per request.
-- BENCH_MODE: "first" (a new key every request), "replay" (cycle over BENCH_REPLAY_KEYS keys
-- created beforehand), "cold" (keys created beforehand, each sent once: see below), "none" (no
-- key), "get" (a bare GET). Keys are UUIDs, which drf-idempotencykey insists on:
-- <run prefix>-<thread>-4000-8000-<number>; replay and cold keys have thread 0000, the scheme
-- benchmarks/run.py creates them with.
-- BENCH_BODY: "payment" (the payment body: its accounts and amount follow the key's thread and
-- number) or "note" (the lightest endpoint's body, its title naming them). Either way each key
-- has a body of its own, and a replay sends the body its key was created with.
-- Cold mode walks the numbers from BENCH_COLD_START, each once and never again: thread t of
-- BENCH_THREADS sends start + t - 1, then + BENCH_THREADS each request. done() reports the
-- most requests any thread made, so the next run can start past every number this one sent.
local mode = os.getenv("BENCH_MODE") or "first"
local prefix = os.getenv("BENCH_KEY_PREFIX") or "00000000"
local replay_keys = tonumber(os.getenv("BENCH_REPLAY_KEYS") or "1")
local accounts = tonumber(os.getenv("BENCH_ACCOUNTS") or "2")
local body_kind = os.getenv("BENCH_BODY") or "payment"
local cold_start = tonumber(os.getenv("BENCH_COLD_START") or "0")
local thread_count = tonumber(os.getenv("BENCH_THREADS") or "1")
-- BENCH_AUTHORIZATION: an Authorization header to send with every POST ("": none).
local authorization = os.getenv("BENCH_AUTHORIZATION") or ""
counter = 0  -- a global: done() reads each thread's with thread:get()
local thread_number = 1
local threads = {}

function setup(thread)
  thread:set("bench_thread", #threads + 1)
  table.insert(threads, thread)
end

function init(args)
  thread_number = tonumber(bench_thread) or 1  -- set by setup() as a global
end

function key_for(thread, n)
  return string.format("%s-%04x-4000-8000-%012x", prefix, thread, n)
end

-- The body of key_for(thread, n): for thread 0, benchmarks/run.py's body_for(n) and note_body(n).
function body_for(thread, n)
  if body_kind == "note" then
    return string.format(
      '{"title": "bench %04x-%012x", "body": "a note", "done": false}', thread, n)
  end
  n = thread * 16777216 + n
  return string.format(
    '{"amount": "%d.00", "currency": "USD", "source_account": "acc_%d", ' ..
    '"destination_account": "acc_%d"}',
    math.floor(n / accounts) % 1000 + 1, n % accounts + 1, (n + 1) % accounts + 1)
end

function request()
  counter = counter + 1
  if mode == "get" then
    return wrk.format("GET", nil, {})
  end
  -- wrk.format uses these headers instead of wrk.headers, not on top of them
  local headers = {["Content-Type"] = "application/json"}
  if authorization ~= "" then
    headers["Authorization"] = authorization
  end
  local thread, number = thread_number, counter
  if mode == "first" then
    headers["Idempotency-Key"] = key_for(thread_number, counter)
  elseif mode == "replay" or mode == "cold" then
    thread, number = 0, counter % replay_keys
    if mode == "cold" then
      number = cold_start + (counter - 1) * thread_count + thread_number - 1
    end
    headers["Idempotency-Key"] = key_for(0, number)
  end
  return wrk.format("POST", nil, headers, body_for(thread, number))
end

function done(summary, latency, requests)
  local errors = summary.errors
  local most = 0
  for _, thread in ipairs(threads) do
    most = math.max(most, tonumber(thread:get("counter")) or 0)
  end
  io.write(string.format(
    'WRK_RESULT {"requests":%d,"duration_us":%d,"p50_us":%d,"p99_us":%d,' ..
    '"bad_status":%d,"socket_errors":%d,"most_per_thread":%d}\n',
    summary.requests, summary.duration, latency:percentile(50), latency:percentile(99),
    errors.status, errors.connect + errors.read + errors.write + errors.timeout, most))
end
