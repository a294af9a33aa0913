"""The engine and scheduler flags every front door has (`cadence-serve`, `cadence-generate`,
`cadence-batch`; `cadence-reference` takes --model), defined once, with the same names everywhere:
the model, the engine's shape and KV pool, the scheduler's policy, priorities and latency targets,
warm-up, attention and weights, and the device layout (the disaggregated mode's
--prefill_devices / --decode_devices, --tensor_parallel, --num_cpu_devices, multi-host).
`server.runtime` turns their values into engines and a scheduler.
"""

from __future__ import annotations

from absl import flags, logging

from cadence.checkpoints import chat
from cadence.checkpoints.registry import DEFAULT_MODEL
from cadence.engine.config import DEFAULT_PAGE_SIZE, KV_DTYPES, WARMUPS
from cadence.model.config import ModelConfig
from cadence.scheduler.policy import POLICIES
from cadence.scheduler.priority import SLO, PriorityClasses
from cadence.scheduler.request import POOLINGS
from cadence.scheduler.scheduler import KV_RESERVATIONS
from cadence.server.reasoning import PARSERS as REASONING_PARSERS

MODEL_FLAG = flags.DEFINE_string("model", DEFAULT_MODEL, "Model name, GGUF file, HF folder or converted checkpoint.")
NUM_SLOTS = flags.DEFINE_integer("num_slots", 8, "Most sequences in flight at once.", lower_bound=1)
MAX_SEQ_LEN = flags.DEFINE_integer("max_seq_len", 4096, "Longest sequence: prompt + output.", lower_bound=16)
PAGE_SIZE = flags.DEFINE_integer("page_size", DEFAULT_PAGE_SIZE, "Tokens per KV page.", lower_bound=1)
KV_MEMORY = flags.DEFINE_string(
    "kv_cache_memory", None,
    "Bytes for the KV page pool (a count, or with a unit: 1440MiB, 1.5GiB); with "
    "--tensor_parallel, per device. Default: on a GPU 90% of what is free after the weights; "
    "elsewhere num_slots x max_seq_len tokens' worth.")
# vLLM's names for the 8-bit float pools.
KV_DTYPE_ALIASES = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}
KV_DTYPE = flags.DEFINE_enum(
    "kv_cache_dtype", "auto", ["auto", *KV_DTYPES, *KV_DTYPE_ALIASES],
    "The KV pool's dtype. auto: the compute dtype (float32 on the CPU, bfloat16 on a GPU). A "
    "16-bit pool on the CPU holds twice the tokens in the same memory, each key and value "
    "rounded to 16 bits (llama.cpp's default cache is float16); an 8-bit float pool "
    "(float8_e4m3fn, or vLLM's fp8; float8_e5m2) four times, each rounded to 3 or 2 mantissa "
    "bits and saturated, which costs accuracy (docs/models.md). Attention still computes in "
    "float32 (bfloat16 on a GPU, where the Mosaic GPU kernels read a pool of the compute dtype "
    "only).")
PREFILL_CHUNK = flags.DEFINE_integer("prefill_chunk", 256, "Largest prefill chunk (tokens).", lower_bound=16)
MAX_PREFILL_CHUNKS = flags.DEFINE_integer(
    "max_prefill_chunks", None,
    "Most prompt chunks one prefill program carries (default: num_slots). 1 runs each chunk as "
    "a program of its own, the baseline packing is measured against.", lower_bound=1)
TOKEN_BUDGET = flags.DEFINE_integer(
    "token_budget", None, "Tokens per iteration, decode + prefill (default: prefill_chunk + num_slots)."
)
POLICY = flags.DEFINE_enum("policy", "chunked", POLICIES, "Iteration policy.")
ITL_TARGET = flags.DEFINE_float(
    "itl_target", None,
    "Seconds an iteration should take while requests decode (chunked policy): each iteration's "
    "prefill is sized to it by the measured cost of the server's recent iterations, its chunks "
    "at a long prompt's end smaller than at its start, so that a long prompt stretches no "
    "stream's gap between tokens past it; at least one pack block of prompt an iteration. "
    "Default: chunks sized by --prefill_chunk and --token_budget alone.")
flags.register_validator("itl_target", lambda v: v is None or 0 < v < float("inf"),
                         "--itl_target must be positive seconds")
DECODE_STEPS = flags.DEFINE_integer(
    "decode_steps", 1,
    "Most decode steps one dispatch runs when an iteration has only decoding to do (every "
    "request with that many tokens to go and no stop strings): less host work per token, "
    "tokens reach clients k at a time.", lower_bound=1)
SPECULATIVE = flags.DEFINE_enum(
    "speculative", None, ["off", "ngram", "draft"],
    "Speculative decoding: each step drafts some tokens ahead, and one verify step keeps those "
    "the model's own sampling agrees with: the same output, several tokens a step while drafts "
    "are accepted. ngram: prompt lookup, the tokens that followed the sequence's last n-gram "
    "where it occurred before (answers that quote or edit their prompt); draft: prompt lookup "
    "first, and where it finds nothing a smaller model's greedy continuation (--draft_model). Applies while at most --speculative_max_batch "
    "requests decode; the verify program compiles at the first chance to draft (or at warm-up "
    "with --warmup=all). Default: draft with --draft_model, else ngram.")
DRAFT_MODEL = flags.DEFINE_string(
    "draft_model", None,
    "A smaller model of the same vocabulary whose greedy continuations speculative decoding "
    "drafts (as --model: a name, GGUF file, HF folder or converted checkpoint), e.g. "
    "Qwen2.5-Coder-0.5B for Qwen2.5-Coder-7B. It runs beside the model on its own KV pool, "
    "--speculative_max_batch sequences of --max_seq_len, and its weights as --weights says.")
LORA = flags.DEFINE_multi_string(
    "lora", [],
    "A LoRA adapter served beside the model, NAME=PATH (or PATH, named after its file or "
    "folder): a PEFT folder (adapter_config.json, adapter_model.safetensors) or a GGUF adapter "
    "(llama.cpp's convert_lora_to_gguf.py). Repeat for more. A request uses one by giving its "
    "NAME as the model; llama-server's /completion mixes them with `lora: [{id, scale}]`, ids in "
    "the order given here. Every adapter sits in one bank the programs read, so requests on "
    "different adapters (and none) decode in one batch.")
MAX_LORA_RANK = flags.DEFINE_integer(
    "max_lora_rank", 0,
    "The highest LoRA rank the bank holds (0: the highest of --lora's adapters, at least 16 "
    "where --max_loras leaves slots free).", lower_bound=0)
MAX_LORAS = flags.DEFINE_integer(
    "max_loras", 0,
    "LoRA adapters the bank holds at once (0: as many as --lora gives). Slots beyond --lora's "
    "take adapters loaded while serving (cadence-serve --runtime_lora); the bank then holds "
    "every projection.", lower_bound=0)
DRAFT_P_MIN = flags.DEFINE_float(
    "draft_p_min", 0.75,
    "With --draft_model: a step's drafts for a request end before the first the draft model "
    "gave less than this probability (llama.cpp's --draft-p-min); 0 drafts all "
    "--num_speculative_tokens.", lower_bound=0.0, upper_bound=0.99)
flags.register_multi_flags_validator(
    ["speculative", "draft_model"],
    lambda f: (f["speculative"] == "draft") == bool(f["draft_model"]) or f["speculative"] is None,
    "--speculative=draft drafts from --draft_model: give both, or neither")
NUM_SPECULATIVE_TOKENS = flags.DEFINE_integer(
    "num_speculative_tokens", None,
    "With --speculative: most draft tokens a step verifies per request (default: 3 on the CPU "
    "kernels, whose matmuls read the weights once for up to 4 rows; 4 elsewhere).", lower_bound=1)
SPECULATIVE_MAX_BATCH = flags.DEFINE_integer(
    "speculative_max_batch", None,
    "With --speculative: most decoding requests for which a step drafts; with more, steps decode "
    "plainly (default: 1 on the CPU, where a verify step's rows cost their compute; 8 on a GPU).",
    lower_bound=1)
PROMPT_LOOKUP_MIN = flags.DEFINE_integer(
    "prompt_lookup_min", 2, "With --speculative=ngram: the shortest n-gram matched.", lower_bound=1)
PROMPT_LOOKUP_MAX = flags.DEFINE_integer(
    "prompt_lookup_max", 4, "With --speculative=ngram: the longest n-gram matched.", lower_bound=1)
MAX_LOGPROBS = flags.DEFINE_integer(
    "max_logprobs", 20,
    "Most alternatives per token a request may ask for (top_logprobs; logprobs on completions); "
    "more is a 400. The programs compute this many, in steps where some request asks.",
    lower_bound=0)
KV_RESERVATION = flags.DEFINE_enum(
    "kv_reservation", "live", KV_RESERVATIONS,
    "live: a request holds the KV pages its tokens fill; max: max_seq_len tokens' worth from the "
    "start, like a contiguous slot (a baseline for benchmarks).")
MAX_QUEUE = flags.DEFINE_integer("max_queue", 256, "Waiting requests before refusing new ones.", lower_bound=1)
PRIORITY_CLASSES = flags.DEFINE_string(
    "priority_classes", "",
    "The priority of a request that sends none, by prompt length: TOKENS=PRIORITY[,...], e.g. "
    "1024=1 (prompts of more than 1024 tokens get priority 1, below the default 0; lower runs "
    "first and may preempt higher numbers).")
LOWER_SHARE = flags.DEFINE_float(
    "lower_share", 0.25,
    "With several priorities prefilling, the least fraction of the prefill budget the lower ones "
    "get (they are slowed, never starved).", lower_bound=0.0, upper_bound=1.0)
SLO_TTFT = flags.DEFINE_string(
    "slo_ttft", "",
    "Time-to-first-token targets per priority, PRIORITY=SECONDS[,...], e.g. 0=2,1=120: a request "
    "predicted to miss its target (by more than --slo_margin) is refused at once with 429 and "
    "Retry-After.")
SLO_ITL = flags.DEFINE_string(
    "slo_itl", "",
    "Inter-token targets per priority, PRIORITY=SECONDS[,...]: while decode steps take longer "
    "(by more than --slo_margin), new requests of that priority are refused with 429.")
SLO_MARGIN = flags.DEFINE_float(
    "slo_margin", 0.25, "How far past a target a prediction must be to refuse (a fraction).",
    lower_bound=0.0)


def _parses(parse):
    def check(value: str) -> bool:
        try:
            parse(value)
        except ValueError as e:
            raise flags.ValidationError(str(e)) from None
        return True
    return check


flags.register_validator("priority_classes", _parses(PriorityClasses.parse))
flags.register_multi_flags_validator(
    ["prompt_lookup_min", "prompt_lookup_max"],
    lambda f: f["prompt_lookup_min"] <= f["prompt_lookup_max"],
    "--prompt_lookup_min must be at most --prompt_lookup_max")
flags.register_validator("slo_ttft", _parses(lambda v: SLO.parse(ttft=v)))
flags.register_validator("slo_itl", _parses(lambda v: SLO.parse(itl=v)))
WARMUP = flags.DEFINE_enum(
    "warmup", "needed", WARMUPS,
    "Which programs warm-up compiles before /health says ok. needed: those every request runs "
    "(prefill and decode); the programs only some requests run (echo and prompt logprobs, "
    "response formats and forced tool calls, penalties, n > 1) compile on first use, on a "
    "thread of their own, while the request that needs them waits (others do not). all: every "
    "program first, so no request ever waits for a compile (benchmarks, steady latency).")
WARMUP_THREADS = flags.DEFINE_integer(
    "warmup_threads", None,
    "Programs compiled at once during warm-up (default: one per two cores).",
    lower_bound=1)
STRUCTURED_OUTPUT = flags.DEFINE_bool(
    "structured_output", True,
    "Serve response_format and forced tool calls: compiles the two halves of a decode step that "
    "a grammar's bitmask goes between (more programs to warm up); --nostructured_output refuses "
    "those requests with a 400.")
GRAMMAR_TIMEOUT = flags.DEFINE_float(
    "grammar_timeout", 10.0,
    "Seconds a response format's or a tool choice's grammar may take to compile (on threads of "
    "its own, never delaying other requests); longer is a 400.", lower_bound=0.001)
POOLING = flags.DEFINE_enum(
    "pooling", None, list(POOLINGS),
    "How embeddings (/v1/embeddings, llama-server's /embedding, cadence-batch's input lines) pool "
    "a prompt's final hidden states: last, its last token's (vLLM's default for a decoder, what "
    "embedding models of the Llama family are trained for), or mean, over every token. Default: "
    "the checkpoint's own (a GGUF's pooling_type, a sentence-transformers folder's Pooling "
    "module) where it is one of these, else last.")
def pooling(config: ModelConfig) -> str:
    """--pooling, or where not given the checkpoint's own (`ModelConfig.pooling`) where cadence
    pools that way, else "last" (logged where the checkpoint asked for another)."""
    if POOLING.value is not None:
        return POOLING.value
    if config.pooling in POOLINGS:
        return config.pooling
    if config.pooling not in (None, "none"):
        logging.warning("%s's checkpoint pools its embeddings by %r, which cadence does not do; "
                        "embeddings pool the last token (--pooling chooses)", config.name, config.pooling)
    return "last"


REASONING_PARSER = flags.DEFINE_enum(
    "reasoning_parser", "auto", list(REASONING_PARSERS),
    "Split a chat answer's reasoning (<think>...</think>) out of its content, into "
    "message.reasoning_content (streamed as delta.reasoning_content), as llama-server and vLLM's "
    "--reasoning-parser do. auto: for models whose chat template speaks of <think> (Qwen3, "
    "DeepSeek-R1's distillations); think (or vLLM's names qwen3, deepseek_r1): always; none: "
    "never. A server request's separate_reasoning: false keeps its reasoning in the content; "
    "cadence-batch writes a chat line's reasoning as its result's reasoning_content.")
CHAT_TEMPLATE = flags.DEFINE_string(
    "chat_template", None,
    "The chat template to render chats with instead of the model's own: a file (a Jinja "
    "template, as vLLM's --chat-template and llama-server's --chat-template-file take it), the "
    "template's text itself, or a name (chatml). For a model whose file has no template, or a "
    "wrong one. Default: the model's own, else ChatML.")
CHAT_TEMPLATE_KWARGS = flags.DEFINE_string(
    "chat_template_kwargs", None,
    "A JSON object of more variables for every chat's template, beneath a request's own "
    "chat_template_kwargs (llama-server's --chat-template-kwargs, vLLM's "
    "--default-chat-template-kwargs): '{\"enable_thinking\": false}' turns Qwen3's thinking off "
    "unless a request turns it on.")
flags.register_validator("chat_template", _parses(lambda v: v is None or chat.template_of(v)))
flags.register_validator("chat_template_kwargs", _parses(lambda v: v is None or chat.variables_of(v)))
PREFIX_CACHING = flags.DEFINE_bool(
    "prefix_caching", True,
    "Reuse the KV of prompt prefixes computed before, to the token (automatic prefix caching: a "
    "full page's KV is found by the hash of its tokens and everything before them, the rest "
    "copied from the cached page after them that agrees longest); --noprefix_caching computes "
    "every prompt from scratch.")
HOST_KV_MEMORY = flags.DEFINE_string(
    "host_kv_cache_memory", "0",
    "Host memory for the prefix cache's second tier (a count, or with a unit: 4GiB): the full "
    "KV pages the pool evicts are copied there, and back into the pool when a later prompt "
    "starts with them, instead of being computed again (llama-server's --cache-ram, SGLang's "
    "HiCache). It fills as pages are evicted, up to this size, and then drops the page used "
    "longest ago. 0: no host tier.")
SLOT_SAVE_PATH = flags.DEFINE_string(
    "slot_save_path", None,
    "A folder for llama-server's slot files (cadence-serve): POST /slots/{id}?action=save writes "
    "the KV of what the slot last held (the prefix cache's whole pages of it) to a file there, "
    "?action=restore puts a file's pages back into the prefix cache, ?action=erase drops them "
    "(llama-server's --slot-save-path). Unset: those actions answer 501.")
ATTENTION = flags.DEFINE_enum(
    "attention", None, ["pallas", "mosaic", "cpu", "xla", "reference"],
    "Attention implementation (default: pallas on GPU, Triton kernels; mosaic: the same as Mosaic "
    "GPU kernels for Hopper, bfloat16 only; on CPU, cpu where --cpu_kernels applies, else xla; "
    "pallas on CPU runs interpreted; reference is the plain einsum oracle).",
)
CPU_KERNELS = flags.DEFINE_bool(
    "cpu_kernels", True,
    "On the CPU, decode with cadence's C++ kernels (model/cpu_kernels.cc, built once with the "
    "system's compiler): paged attention, and the matmuls over a blocked copy of the weights "
    "(float32, int8, or a GGUF's own blocks: --weights). float32 compute on one device; false: "
    "XLA's paths.")
CPU_ACTIVATIONS = flags.DEFINE_enum(
    "cpu_activations", "float32", ("float32", "int8"),
    "What the CPU kernels' matmuls over a GGUF's own blocks take as activations. float32: the "
    "file's weights against the activations as they are (the reference's numbers, token for "
    "token). int8: activations quantized per 32 values, integer dot products, as llama.cpp "
    "computes: faster decode (docs/cpu-kernels.md), numbers no longer the reference's.")
LAYER_LOOP = flags.DEFINE_bool(
    "layer_loop", True,
    "Where the CPU kernels run the model, run its layers as one loop over weights and a KV pool "
    "stacked over layers: each program compiles and holds one layer's kernels, not every "
    "layer's (a third of the programs' memory, half the warm-up). --nolayer_loop unrolls them.")
WEIGHTS = flags.DEFINE_enum(
    "weights", "auto", ("auto", "float", "int8", "int4"),
    "auto: where decode runs on the CPU kernels, the matrices a GGUF checkpoint stores "
    "block-quantized (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, the K-quants Q2_K to Q6_K, and IQ4_NL, IQ4_XS) are read as "
    "they are, everything else as float; "
    "float: every matrix in --dtype (a GGUF's blocks dequantized); int8, int4: every matrix "
    "quantized when loaded, weight-only (activations and the KV cache stay in --dtype): on the "
    "CPU kernels in groups of 32 weights with a float16 scale (int4 also a minimum, as GGUF's "
    "Q8_0 and Q4_1; int4 keeps a tied LM head in int8), decode reading them and prefill what "
    "they stand for; elsewhere int8 has a scale per output channel, and int4 is refused.")
DTYPE = flags.DEFINE_enum(
    "dtype", None, ["float32", "bfloat16"], "Compute dtype (default: bfloat16 on GPU, float32 on CPU)."
)
NUM_CPU_DEVICES = flags.DEFINE_integer(
    "num_cpu_devices", None,
    "On the CPU, how many JAX devices to make of it (jax_num_cpu_devices), e.g. 2 for "
    "--prefill_devices=0 --decode_devices=1. They share the same cores and memory bandwidth: "
    "the disaggregated mode can be checked and its protocol's cost measured, not its isolation.",
    lower_bound=1)
PREFILL_DEVICES = flags.DEFINE_list(
    "prefill_devices", None,
    "Disaggregated serving (with --decode_devices): the JAX device index of the prefill engine, "
    "which admits and prefills prompts and hands their KV on.")
DECODE_DEVICES = flags.DEFINE_list(
    "decode_devices", None,
    "Disaggregated serving (with --prefill_devices): the JAX device index of the decode engine.")
TENSOR_PARALLEL = flags.DEFINE_integer(
    "tensor_parallel", 1,
    "Devices one engine spans (tensor parallelism over the first N JAX devices): heads, the "
    "MLP and the vocabulary are split where they divide, the KV pool by KV head. On the CPU, "
    "--num_cpu_devices=N makes N devices (which check the protocol, not the speed).",
    lower_bound=1)
COORDINATOR = flags.DEFINE_string(
    "coordinator_address", None,
    "Multi-host (with --num_processes and --process_id): process 0's host:port, where "
    "jax.distributed's coordinator listens; the engine's plan goes over the next port. Every "
    "process runs the same command; process 0 serves, the others follow it.")
NUM_PROCESSES = flags.DEFINE_integer(
    "num_processes", 1, "Multi-host: how many processes (hosts) one engine spans.", lower_bound=1)
PROCESS_ID = flags.DEFINE_integer("process_id", 0, "Multi-host: this process's index.", lower_bound=0)
PREFILL_SLOTS = flags.DEFINE_integer(
    "prefill_slots", None,
    "Disaggregated: sequences the prefill engine holds at once, prefilling or waiting for the "
    "decode engine (the transfer backlog's bound; default num_slots).", lower_bound=1)
