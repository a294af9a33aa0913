"""`cadence-bench`: the mixed-workload benchmark's front door.

    cadence-bench run       [--base_url=URL | cadence flags]  one run: JSON, table, plots
    cadence-bench compare   --configs=prefill-first@256,chunked@256,chunked@64
    cadence-bench compare   --configs=chunked@128,disaggregated@128 --slo=chat_itl_p99=0.25,chat_ttft_p99=2
    cadence-bench capacity  --slo=chat_itl_p99=0.25,chat_ttft_p99=2 [--load_low=.. --load_high=..]
    cadence-bench compare   --configs=chunked@256,chunked@256:priority_classes=1024=1 --doc_rate=0.3
    cadence-bench capacity  --scale_class=document --configs=chunked@256:priority_classes=1024=1
    cadence-bench roofline  [--run=run.json] [--bandwidth_gb_s=.. --flops_gflop_s=..]
    cadence-bench bill      --run=run.json --price_input=.. --price_cached_input=.. --price_output=..
    cadence-bench plot      --runs=a.json,b.json
    cadence-bench conversations [--conversations=4 --turns=5 --system_tokens=600]   multi-turn chat
    cadence-bench shared_prefix [--groups=4 --prompts_per_group=8 --prefix_tokens=1000]
    cadence-bench fleet     [--replicas=2 --router_policies=cache_aware,round_robin
                             --fleet_workload=conversations]       replicas behind sglang-router

Without --base_url, `run` and `capacity` start cadence-serve themselves (--model, --num_slots,
--max_seq_len, --prefill_chunk, --policy), as do `conversations` and `shared_prefix`, which
report per turn how much of each prompt the server reused; `compare` always does, once per
configuration, and `fleet` starts --replicas of them behind sglang-router (`bench/fleet.py`). With
--base_url (ending in /v1) the client talks to any OpenAI-compatible server: pass --api_key,
--model, --endpoint, and --noignore_eos for APIs that reject vLLM's `ignore_eos`.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import signal
import sys
from pathlib import Path

from absl import app, flags


# target
_BASE_URL = flags.DEFINE_string("base_url", None, "OpenAI-compatible base URL (…/v1); unset: start cadence.")
_API_KEY = flags.DEFINE_string("api_key", None, "Bearer token for --base_url.")
_MODEL = flags.DEFINE_string("model", "smollm2-135m", "Model name sent in requests (and served, when spawning).")
_ENDPOINT = flags.DEFINE_enum("endpoint", "chat", ["chat", "completions"], "/v1/chat/completions or /v1/completions.")
_IGNORE_EOS = flags.DEFINE_bool("ignore_eos", True, "Send ignore_eos so outputs have the drawn lengths.")
_EXTRA_BODY = flags.DEFINE_string(
    "extra_body", None, 'JSON object merged into every request, e.g. \'{"cache_prompt": false}\' '
    "for llama.cpp's llama-server.")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "Sampling temperature sent with each request.")
# cadence, when spawned
_SLOTS = flags.DEFINE_integer("num_slots", 8, "cadence --num_slots.")
_MAX_SEQ = flags.DEFINE_integer("max_seq_len", 4096, "cadence --max_seq_len.")
_CHUNK = flags.DEFINE_integer("prefill_chunk", 256, "cadence --prefill_chunk.")
_POLICY = flags.DEFINE_enum("policy", "chunked", ["chunked", "prefill-first"], "cadence --policy.")
_BUDGET = flags.DEFINE_integer("token_budget", None, "cadence --token_budget.")
_CONFIGS = flags.DEFINE_list("configs", ["prefill-first@256", "chunked@256", "chunked@64"],
                             "compare: POLICY@CHUNK[:FLAG=VALUE...] per server; FLAG is a "
                             "cadence-serve flag, or repo=PATH to serve from another checkout; "
                             "POLICY disaggregated is chunked on a prefill and a decode device.")
_HEALTH_TIMEOUT = flags.DEFINE_float("health_timeout", 1200, "Seconds to wait for a spawned server's /health.")
# workload
_CHAT_CONC = flags.DEFINE_integer("chat_concurrency", 4, "Closed-loop chat streams (the default for chats).")
_CHAT_RATE = flags.DEFINE_float("chat_rate", None, "Open-loop chat arrivals per second (Poisson), if given.")
_DOC_CONC = flags.DEFINE_integer("doc_concurrency", None, "Closed-loop documents in flight, if given.")
_DOC_RATE = flags.DEFINE_float("doc_rate", 0.1, "Open-loop document arrivals per second (the default for documents).")
_CHAT_PROMPT = flags.DEFINE_list("chat_prompt", ["50", "400"], "Chat prompt tokens LOW,HIGH (approximate).")
_CHAT_OUTPUT = flags.DEFINE_list("chat_output", ["64", "256"], "Chat max_tokens LOW,HIGH.")
_DOC_PROMPT = flags.DEFINE_list("doc_prompt", ["2000", "3500"],
                                "Document prompt tokens LOW,HIGH (the issue's 2000,7000 needs --max_seq_len=8192).")
_DOC_OUTPUT = flags.DEFINE_list("doc_output", ["32", "128"], "Document max_tokens LOW,HIGH.")
_SEED = flags.DEFINE_integer("seed", 0, "Workload seed: prompts, lengths and arrival times.")
_WARMUP = flags.DEFINE_float("warmup", 10, "Seconds of load before the observation window (excluded).")
_DURATION = flags.DEFINE_float("duration", 60, "Observation window, seconds.")
_DRAIN = flags.DEFINE_float("drain_timeout", 300, "Seconds in-flight requests may take after the window.")
# outputs and experiment knobs
_OUT_DIR = flags.DEFINE_string("out_dir", None, "Output folder (default bench/results/<command>-<time>).")
_SLO = flags.DEFINE_list("slo", ["chat_itl_p99=0.25", "chat_ttft_p99=2", "error_rate=0"],
                         "capacity, and compare's verdict: KEY=VALUE SLOs: chat_itl_p99 (or _max), <class>_ttft_p99, "
                         "<class>_completion_p99, <class>_rate_p10 (a minimum), error_rate.")
_LOAD_LOW = flags.DEFINE_float("load_low", 0.25, "capacity: lowest load factor tried.")
_LOAD_HIGH = flags.DEFINE_float("load_high", 4.0, "capacity: highest load factor tried.")
_STEPS = flags.DEFINE_integer("bisect_steps", 4, "capacity: bisection steps between low and high.")
_SCALE_CLASS = flags.DEFINE_enum("scale_class", None, ["chat", "document"],
                                 "capacity: scale this class's load alone (unset: every class).")
_RUN = flags.DEFINE_list("run", None, "roofline/bill: run JSON file(s).")
_RUNS = flags.DEFINE_list("runs", None, "plot: run JSON files.")
_BANDWIDTH = flags.DEFINE_float("bandwidth_gb_s", None, "roofline: memory bandwidth (unset: measure).")
_FLOPS = flags.DEFINE_float("flops_gflop_s", None, "roofline: FLOP/s in GFLOP/s (unset: measure).")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "roofline: weight and KV dtype.")
_OFFSET = flags.DEFINE_integer("pipeline_offset", 1, "roofline: iteration i's work shows in wall time of i+offset.")
_PRICE_IN = flags.DEFINE_float("price_input", None, "bill: input price per million tokens.")
_PRICE_CACHED = flags.DEFINE_float("price_cached_input", None,
                                   "bill: cached input price per million (default: the input price).")
_PRICE_OUT = flags.DEFINE_float("price_output", None, "bill: output price per million tokens.")
_CURRENCY = flags.DEFINE_string("currency", "USD", "bill: currency label.")
# conversations / shared_prefix
_CONVERSATIONS = flags.DEFINE_integer("conversations", 4, "conversations: concurrent conversations.", lower_bound=1)
_TURNS = flags.DEFINE_integer("turns", 5, "conversations: turns per conversation.", lower_bound=1)
_SYSTEM_TOKENS = flags.DEFINE_integer("system_tokens", 600, "conversations: system prompt tokens (approximate).",
                                      lower_bound=1)
_USER_TOKENS = flags.DEFINE_list("user_tokens", ["40", "120"], "conversations: user message tokens LOW,HIGH.")
_REPLY_TOKENS = flags.DEFINE_integer("reply_tokens", 32, "conversations / shared_prefix: max_tokens per reply.",
                                     lower_bound=1)
_GROUPS = flags.DEFINE_integer("groups", 4, "shared_prefix: distinct prefixes.", lower_bound=1)
_PER_GROUP = flags.DEFINE_integer("prompts_per_group", 8, "shared_prefix: questions per prefix.", lower_bound=1)
_PREFIX_TOKENS = flags.DEFINE_integer("prefix_tokens", 1000, "shared_prefix: prefix tokens (approximate).",
                                      lower_bound=1)
_QUESTION_TOKENS = flags.DEFINE_list("question_tokens", ["20", "60"], "shared_prefix: question tokens LOW,HIGH.")
_CONCURRENCY = flags.DEFINE_integer("concurrency", 4, "shared_prefix: requests in flight.", lower_bound=1)
_REPLICAS = flags.DEFINE_integer("replicas", 2, "fleet: cadence-serve replicas behind sglang-router.", lower_bound=1)
_ROUTER_POLICIES = flags.DEFINE_list(
    "router_policies", ["cache_aware", "round_robin"],
    "fleet: sglang-router policies, one fleet each (fresh replicas: every fleet starts with cold "
    "caches); POLICY[:FLAG=VALUE...] passes --FLAG VALUE to that router, e.g. "
    "cache_aware:balance-abs-threshold=2.")
_FLEET_WORKLOAD = flags.DEFINE_enum("fleet_workload", "conversations", ["conversations", "shared_prefix"],
                                    "fleet: the prefix-reuse workload sent through the router.")
_SINGLE = flags.DEFINE_bool("single_replica", True,
                            "fleet: first run the workload on one replica (behind the router, on every "
                            "core), for the hit rate a fleet should keep.")
_ROUTER_FLAGS = flags.DEFINE_string("router_flags", "", "fleet: more sglang-router flags, space-separated.")


def _range(values: list[str], name: str) -> tuple[int, int]:
    try:
        low, high = (int(v) for v in values)
    except ValueError:
        raise app.UsageError(f"--{name} takes LOW,HIGH integers, got {','.join(values)}") from None
    return low, high


def workload():
    from cadence.bench.workload import ClassSpec, WorkloadSpec

    def loop(rate, concurrency, default_open: bool) -> dict:
        """An explicitly given --X_rate means open loop, --X_concurrency closed; else the default."""
        open_loop = rate.present or (default_open and not concurrency.present)
        if open_loop:
            return {"rate": rate.value, "concurrency": None}
        return {"rate": None, "concurrency": concurrency.value or 0}

    chat = ClassSpec.chat(**loop(_CHAT_RATE, _CHAT_CONC, default_open=False),
                          prompt_tokens=_range(_CHAT_PROMPT.value, "chat_prompt"),
                          output_tokens=_range(_CHAT_OUTPUT.value, "chat_output"))
    doc = ClassSpec.document(**loop(_DOC_RATE, _DOC_CONC, default_open=True),
                             prompt_tokens=_range(_DOC_PROMPT.value, "doc_prompt"),
                             output_tokens=_range(_DOC_OUTPUT.value, "doc_output"))
    return WorkloadSpec((chat, doc), seed=_SEED.value, warmup_s=_WARMUP.value, duration_s=_DURATION.value,
                        drain_timeout_s=_DRAIN.value)


def server_config(policy: str | None = None, chunk: int | None = None):
    from cadence.bench.cadence_server import ServerConfig

    return ServerConfig(model=_MODEL.value, num_slots=_SLOTS.value, max_seq_len=_MAX_SEQ.value,
                        prefill_chunk=chunk or _CHUNK.value, policy=policy or _POLICY.value,
                        token_budget=_BUDGET.value)


def check_fits(spec) -> None:
    """Refuses a workload whose longest request cannot fit cadence's --max_seq_len. The prompt
    estimate gets a 10% + 64-token margin (SmolLM2's tokenizer and chat template measured 0.9-1.3x
    the estimate: over 1 only for short chats, where the template's tokens weigh most)."""
    for c in spec.classes:
        need = int(c.prompt_tokens[1] * 1.1) + 64 + c.output_tokens[1]
        if need > _MAX_SEQ.value:
            raise app.UsageError(f"class {c.name}: prompts up to ~{c.prompt_tokens[1]} tokens (+10% + 64 "
                                 f"margin) + {c.output_tokens[1]} output may exceed --max_seq_len={_MAX_SEQ.value}; "
                                 f"raise --max_seq_len or lower the prompt range")


def target(base_url: str | None = None):
    from cadence.bench.client import Target

    return Target(base_url=base_url or _BASE_URL.value or "http://unset/v1", model=_MODEL.value,
                  api_key=_API_KEY.value, endpoint=_ENDPOINT.value, ignore_eos=_IGNORE_EOS.value,
                  temperature=_TEMPERATURE.value, extra_body=extra_body())


def extra_body() -> tuple[tuple[str, object], ...]:
    if not _EXTRA_BODY.value:
        return ()
    try:
        fields = json.loads(_EXTRA_BODY.value)
    except json.JSONDecodeError as e:
        raise app.UsageError(f"--extra_body is not JSON: {e}") from None
    if not isinstance(fields, dict):
        raise app.UsageError(f"--extra_body must be a JSON object, got {_EXTRA_BODY.value}")
    return tuple(fields.items())


def out_dir(command: str) -> Path:
    if _OUT_DIR.value:
        return Path(_OUT_DIR.value)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path("bench/results") / f"{command}-{stamp}"


def cmd_run() -> None:
    from cadence.bench import experiments
    from cadence.bench.cadence_server import spawned

    spec, out = workload(), out_dir("run")
    if _BASE_URL.value:
        report = experiments.single_run(spec, target(), out, {"server": {"base_url": _BASE_URL.value}})
    else:
        check_fits(spec)
        config = server_config()
        with spawned(config, out / "serve.log", _HEALTH_TIMEOUT.value) as base_url:
            report = experiments.single_run(spec, target(base_url), out, {"server": dataclasses.asdict(config)})
    images = experiments._plots({"run": report}, out)
    print(f"wrote {out}/run.json and {', '.join(p.name for p in images)}", file=sys.stderr)


def cmd_compare() -> None:
    from cadence.bench import experiments

    from cadence.bench.cadence_server import parse_config

    try:
        configs = [parse_config(item, server_config()) for item in _CONFIGS.value]
    except ValueError as e:
        raise app.UsageError(str(e)) from None
    spec = workload()
    check_fits(spec)
    estimate = None
    if any("--prefill_devices" in " ".join(c.extra_flags) for c in configs):
        from cadence.bench import roofline
        from cadence.model.config import LLAMA3_8B

        served = roofline.load_config("smollm2-135m" if _MODEL.value == "smollm2-135m" else _MODEL.value)
        estimate = roofline.format_transfer_estimate([
            roofline.transfer_estimate(served, 4, (512, 2048, 3500)),
            roofline.transfer_estimate(LLAMA3_8B, 2, (512, 2048, 8192))])
    try:
        slos = experiments.parse_slos(_SLO.value) if _SLO.present or estimate else None
    except ValueError as e:
        raise app.UsageError(str(e)) from None
    experiments.compare(spec, configs, target(), out_dir("compare"), _HEALTH_TIMEOUT.value,
                        slos=slos, estimate=estimate)


def cmd_capacity() -> None:
    from cadence.bench import experiments

    from cadence.bench.cadence_server import parse_config

    spec = workload()
    slos = experiments.parse_slos(_SLO.value)
    server = None
    if not _BASE_URL.value:
        check_fits(spec)
        server = server_config()
        if _CONFIGS.present:  # one entry: the server to search, e.g. with its priority flags
            if len(_CONFIGS.value) != 1:
                raise app.UsageError("capacity searches one server: give --configs one entry")
            try:
                server = parse_config(_CONFIGS.value[0], server)
            except ValueError as e:
                raise app.UsageError(str(e)) from None
    experiments.capacity(spec, slos, target(), out_dir("capacity"), server=server,
                         low=_LOAD_LOW.value, high=_LOAD_HIGH.value, steps=_STEPS.value,
                         health_timeout_s=_HEALTH_TIMEOUT.value, only=_SCALE_CLASS.value)


def cmd_roofline() -> None:
    from cadence.bench import roofline
    from cadence.bench.report import write_json

    config = roofline.load_config(_MODEL.value)
    if _BANDWIDTH.value and _FLOPS.value:
        machine = roofline.Machine(_BANDWIDTH.value, _FLOPS.value)
    else:
        machine = roofline.measure_machine()
    itemsize = 4 if _DTYPE.value == "float32" else 2
    rows = roofline.analytic_table(config, machine, itemsize, _MAX_SEQ.value)
    print(roofline.format_rows(rows, machine))
    result = {"model": config.name, "dtype": _DTYPE.value, "machine": vars(machine), "shapes": rows, "runs": {}}
    for path in _RUN.value or []:
        compared = roofline.compare_run(roofline.load_run(path), config, machine, itemsize, _OFFSET.value)
        print(f"\n{path}:\n{roofline.format_comparison(compared)}")
        result["runs"][path] = compared
    out = write_json(out_dir("roofline") / "roofline.json", result)
    print(f"wrote {out}", file=sys.stderr)


def cmd_bill() -> None:
    from cadence.bench.bill import Prices, bill, format_bill
    from cadence.bench.report import load_results

    if _PRICE_IN.value is None or _PRICE_OUT.value is None or not _RUN.value:
        raise app.UsageError("bill needs --run=RUN.json and --price_input and --price_output (per million tokens)")
    prices = Prices(_PRICE_IN.value, _PRICE_OUT.value, _PRICE_CACHED.value, _CURRENCY.value)
    results = [r for path in _RUN.value for r in load_results(json.loads(Path(path).read_text()))]
    estimate = bill(results, prices)
    print(format_bill(estimate))
    print(json.dumps({"bill_total": round(estimate["total"]["cost"], 6), "currency": prices.currency}))


def _prefix_workload(command: str, run) -> None:
    """Runs a prefix-reuse workload against --base_url, or a cadence-serve it starts; writes
    the table and every request to OUT/COMMAND.json."""
    import asyncio

    from cadence.bench import conversations
    from cadence.bench.cadence_server import spawned
    from cadence.bench.report import machine, write_json

    out = out_dir(command)
    out.mkdir(parents=True, exist_ok=True)
    if _BASE_URL.value:
        results, wall = asyncio.run(run(target()))
        server = {"base_url": _BASE_URL.value}
    else:
        config = server_config()
        with spawned(config, out / "serve.log", _HEALTH_TIMEOUT.value) as base_url:
            results, wall = asyncio.run(run(target(base_url)))
        server = dataclasses.asdict(config)
    table = conversations.prefix_table(results, wall)
    print(conversations.format_table(table))
    path = write_json(out / f"{command}.json", {
        "command": " ".join(sys.argv), "server": server, "machine": machine(), "table": table,
        "results": [r.to_dict() for r in results]})
    print(f"wrote {path}", file=sys.stderr)


def prefix_run(name: str):
    """The prefix-reuse workload `name` from the flags: a function of a `Target` to run it."""
    from cadence.bench import conversations as c

    if name == "conversations":
        spec = c.ConversationSpec(_CONVERSATIONS.value, _TURNS.value, _SYSTEM_TOKENS.value,
                                  _range(_USER_TOKENS.value, "user_tokens"), _REPLY_TOKENS.value, _SEED.value)
        return lambda t: c.run_conversations(spec, t)
    spec = c.SharedPrefixSpec(_GROUPS.value, _PER_GROUP.value, _PREFIX_TOKENS.value,
                              _range(_QUESTION_TOKENS.value, "question_tokens"), _REPLY_TOKENS.value,
                              _CONCURRENCY.value, _SEED.value)
    return lambda t: c.run_shared_prefix(spec, t)


def cmd_conversations() -> None:
    _prefix_workload("conversations", prefix_run("conversations"))


def cmd_shared_prefix() -> None:
    _prefix_workload("shared_prefix", prefix_run("shared_prefix"))


def cmd_fleet() -> None:
    """A prefix-reuse workload through sglang-router in front of --replicas cadence-serve
    replicas, once per --router_policies entry (and first on one replica alone): hit rate,
    TTFT and throughput per fleet, in OUT/fleet.json."""
    import asyncio

    from cadence.bench import conversations, fleet
    from cadence.bench.report import machine, write_json

    why = fleet.router_available()
    if why:
        raise app.UsageError(why)
    try:
        policies = [fleet.parse_policy(entry) for entry in _ROUTER_POLICIES.value]
    except ValueError as e:
        raise app.UsageError(f"--router_policies: {e}") from None
    run, out = prefix_run(_FLEET_WORKLOAD.value), out_dir("fleet")
    plan = [("1 replica", 1, "round_robin", ())] if _SINGLE.value else []
    plan += [(f"{_REPLICAS.value} replicas, {entry}", _REPLICAS.value, policy, extra)
             for entry, (policy, extra) in zip(_ROUTER_POLICIES.value, policies)]
    rows, runs = [], []
    for label, replicas, policy, extra in plan:
        print(f"{label}:", file=sys.stderr)
        folder = out / "".join(c if c.isalnum() or c in "-_=" else "-" for c in label)
        with fleet.Fleet(server_config(), replicas, policy, folder, health_timeout_s=_HEALTH_TIMEOUT.value,
                         router_flags=(*extra, *_ROUTER_FLAGS.value.split())) as f:
            before = [fleet.counters(r.url) for r in f.replicas]
            results, wall = asyncio.run(run(target(f.base_url)))
            split = fleet.replica_deltas(before, [fleet.counters(r.url) for r in f.replicas])
            described = f.describe()
        rows.append(fleet.summary(label, results, wall, split))
        table = conversations.prefix_table(results, wall)
        print(conversations.format_table(table), file=sys.stderr)
        runs.append({**described, "label": label, "replica_counters": split, "table": table,
                     "results": [r.to_dict() for r in results]})
    print(fleet.format_summaries(rows))
    path = write_json(out / "fleet.json", {"command": " ".join(sys.argv), "workload": _FLEET_WORKLOAD.value,
                                           "machine": machine(), "summary": rows, "runs": runs})
    print(f"wrote {path}", file=sys.stderr)


def cmd_plot() -> None:
    from cadence.bench import experiments

    if not _RUNS.value:
        raise app.UsageError("plot needs --runs=a.json[,b.json...]")
    out = Path(_OUT_DIR.value) if _OUT_DIR.value else Path(_RUNS.value[0]).parent
    for p in experiments.replot(_RUNS.value, out):
        print(p)


# Each subcommand and the function that runs it, in the order the usage line lists them.
COMMANDS = {"run": cmd_run, "compare": cmd_compare, "capacity": cmd_capacity, "roofline": cmd_roofline,
            "bill": cmd_bill, "plot": cmd_plot, "conversations": cmd_conversations,
            "shared_prefix": cmd_shared_prefix, "fleet": cmd_fleet}


def main(argv: list[str]) -> None:
    if len(argv) != 2 or argv[1] not in COMMANDS:
        raise app.UsageError(f"usage: cadence-bench {{{'|'.join(COMMANDS)}}} [--flags]")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    # SIGTERM unwinds like Ctrl-C, so a spawned cadence-serve is stopped too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    COMMANDS[argv[1]]()


def run() -> None:
    app.run(main)


if __name__ == "__main__":
    run()
