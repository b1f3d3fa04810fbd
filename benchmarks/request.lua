-- wrk script: POST the same payment body with an Idempotency-Key per request.
-- BENCH_MODE: "first" (a new key every request), "replay" (cycle over BENCH_REPLAY_KEYS keys
-- created beforehand), "none" (no key), "get" (a bare GET). Keys are UUIDs, which
-- drf-idempotencykey insists on: <run prefix>-<thread>-4000-8000-<counter>.
-- BENCH_BODY: "payment" (the payment body, its accounts following the number) or "note" (the
-- lightest endpoint's body, the same for every request).
local mode = os.getenv("BENCH_MODE") or "first"
local prefix = os.getenv("BENCH_KEY_PREFIX") or "00000000"
local replay_keys = tonumber(os.getenv("BENCH_REPLAY_KEYS") or "1")
local accounts = tonumber(os.getenv("BENCH_ACCOUNTS") or "2")
local body_kind = os.getenv("BENCH_BODY") or "payment"
-- BENCH_AUTHORIZATION: an Authorization header to send with every POST ("": none).
local authorization = os.getenv("BENCH_AUTHORIZATION") or ""
local counter = 0
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

-- The same body as benchmarks/run.py's body_for(number): the account pair follows the number.
function body_for(n)
  if body_kind == "note" then
    return '{"title": "bench", "body": "a note", "done": false}'
  end
  return string.format(
    '{"amount": "1.00", "currency": "USD", "source_account": "acc_%d", ' ..
    '"destination_account": "acc_%d"}', n % accounts + 1, (n + 1) % accounts + 1)
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
  local number = thread_number * 7919 + counter
  if mode == "first" then
    headers["Idempotency-Key"] = key_for(thread_number, counter)
  elseif mode == "replay" then
    number = counter % replay_keys
    headers["Idempotency-Key"] = key_for(0, number)
  end
  return wrk.format("POST", nil, headers, body_for(number))
end

function done(summary, latency, requests)
  local errors = summary.errors
  io.write(string.format(
    'WRK_RESULT {"requests":%d,"duration_us":%d,"p50_us":%d,"p99_us":%d,' ..
    '"bad_status":%d,"socket_errors":%d}\n',
    summary.requests, summary.duration, latency:percentile(50), latency:percentile(99),
    errors.status, errors.connect + errors.read + errors.write + errors.timeout))
end
