"""Multi-host serving on this machine: two CPU processes joined by `jax.distributed` (gloo
collectives), one engine tensor parallel over their two devices. Process 0 runs the front door
and sends each engine call to process 1, which runs the same programs (`engine.multihost`)."""

from __future__ import annotations

import socket
import subprocess
import sys
import pytest

from cadence.checkpoints.tokenizer import Tokenizer
from cadence.engine.reference import greedy_generate
from tests.serving import ROOT, assert_batch_is_the_reference, batch_job

pytestmark = pytest.mark.slow  # the full tier: two processes


def free_port_pair() -> int:
    """A port p with p + 1 free too (the coordinator's, then the plan's)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no two consecutive free ports")


def run_two_processes(tiny_model_dir, module: str, *flags: str, timeout: float = 300):
    root, env = tiny_model_dir
    port = free_port_pair()
    common = [sys.executable, "-m", module, f"--model={root / 'model'}", "--num_slots=2",
              "--max_seq_len=128", "--prefill_chunk=32", "--tensor_parallel=2",
              f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2", *flags]
    follower = subprocess.Popen([*common, "--process_id=1"], cwd=ROOT, env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        leader = subprocess.run([*common, "--process_id=0"], cwd=ROOT, env=env, text=True,
                                capture_output=True, timeout=timeout)
        out, err = follower.communicate(timeout=60)
    finally:
        follower.kill()
    return leader, subprocess.CompletedProcess(follower.args, follower.returncode, out, err)


def test_cadence_generate_over_two_processes_gives_the_reference_text(tiny_model_dir, tiny_params, tiny_config):
    leader, follower = run_two_processes(
        tiny_model_dir, "cadence.server.generate_cli", "--prompt=The capital of France is",
        "--max_tokens=12", "--temperature=0")
    assert leader.returncode == 0, leader.stderr[-3000:]
    assert follower.returncode == 0, follower.stderr[-3000:]
    tok = Tokenizer.from_hf_dir(tiny_model_dir[0] / "model")
    ids = greedy_generate(tiny_params, tiny_config, tok.encode("The capital of France is"), 12, tok.eos_ids)
    assert leader.stdout.rstrip("\n") == tok.decode(ids, skip_special=True)
    assert "compilations_after_warmup: 0" in leader.stderr
    assert "process 1 follows process 0's plan" in follower.stderr
    assert follower.stdout == ""  # only process 0 answers


def test_speculative_decoding_over_two_processes_gives_the_reference_text(tiny_model_dir, tiny_params,
                                                                         tiny_config):
    """Verify steps run on every process (the leader sends them as it sends decode steps): a
    prompt the tiny model keeps repeating drafts, and the text is the reference's."""
    prompt = "the sea the sea the sea the sea"
    leader, follower = run_two_processes(
        tiny_model_dir, "cadence.server.generate_cli", f"--prompt={prompt}", "--max_tokens=40",
        "--temperature=0", "--warmup=all")
    assert leader.returncode == 0, leader.stderr[-3000:]
    assert follower.returncode == 0, follower.stderr[-3000:]
    tok = Tokenizer.from_hf_dir(tiny_model_dir[0] / "model")
    ids = greedy_generate(tiny_params, tiny_config, tok.encode(prompt), 40, tok.eos_ids)
    assert leader.stdout.rstrip("\n") == tok.decode(ids, skip_special=True)
    assert "speculative decoding:" in leader.stderr and "compilations_after_warmup: 0" in leader.stderr


def test_cadence_batch_over_two_processes_gives_the_reference_text(tiny_model_dir, tiny_params, tiny_config, tmp_path):
    prompts, files = batch_job(tmp_path)
    leader, follower = run_two_processes(tiny_model_dir, "cadence.server.batch_cli", *files)
    assert leader.returncode == 0 and follower.returncode == 0, leader.stderr[-3000:] + follower.stderr[-3000:]
    assert_batch_is_the_reference(tmp_path, prompts, tiny_model_dir, tiny_params, tiny_config)
