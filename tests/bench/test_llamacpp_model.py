"""The benchmark's GGUF model: what it writes (read back with gguf's reader) and, where a
llama-server is found, that llama.cpp loads it, tokenizes as it was built to and reuses a turn's
prefix in the next, and that the scheduler's prober reads that server as it reads the double."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import gguf
import httpx
import pytest

from luftpause import config
from luftpause.bench import llamacpp_model as lm
from luftpause.bench.common import free_port
from luftpause.loadgen.conversation import TOOLS, first_messages
from luftpause.scheduler.prober import probe

TINY = lm.Dimensions(embd=32, layers=2, heads=4, kv_heads=2, ff=64, merges=400, context=4096)


def _field(reader: gguf.GGUFReader, key: str) -> object:
    return reader.fields[key].contents()


def test_the_same_options_write_the_same_llama_model_with_its_tokenizer_and_template(tmp_path: Path) -> None:
    a = lm.write(tmp_path / "a.gguf", TINY, seed=7)
    b = lm.write(tmp_path / "b.gguf", TINY, seed=7)
    c = lm.write(tmp_path / "c.gguf", TINY, seed=8)
    assert a.read_bytes() == b.read_bytes()
    assert a.read_bytes() != c.read_bytes()

    reader = gguf.GGUFReader(a)
    assert _field(reader, "general.architecture") == "llama"
    assert _field(reader, "llama.embedding_length") == 32
    assert _field(reader, "llama.block_count") == 2
    assert _field(reader, "llama.attention.head_count") == 4
    assert _field(reader, "llama.attention.head_count_kv") == 2
    assert _field(reader, "llama.feed_forward_length") == 64
    assert _field(reader, "llama.context_length") == 4096
    assert _field(reader, "tokenizer.ggml.model") == "gpt2"
    assert _field(reader, "tokenizer.ggml.pre") == "gpt-2"
    assert _field(reader, "tokenizer.chat_template") == lm.CHAT_TEMPLATE

    tokens = _field(reader, "tokenizer.ggml.tokens")
    merges = _field(reader, "tokenizer.ggml.merges")
    assert isinstance(tokens, list) and isinstance(merges, list)
    assert tokens[:256] == [lm.BYTE_CHARS[b] for b in range(256)]
    assert tokens[-3:] == list(lm.SPECIALS)
    assert 0 < len(merges) <= TINY.merges
    assert all(m.replace(" ", "", 1) in tokens for m in merges)
    assert _field(reader, "llama.vocab_size") == len(tokens)
    assert tokens[int(str(_field(reader, "tokenizer.ggml.eos_token_id")))] == lm.IM_END
    assert tokens[int(str(_field(reader, "tokenizer.ggml.bos_token_id")))] == lm.BOS
    types = _field(reader, "tokenizer.ggml.token_type")
    assert types == [gguf.TokenType.NORMAL] * (len(tokens) - 3) + [gguf.TokenType.CONTROL] * 3

    shapes = {t.name: [int(n) for n in t.shape] for t in reader.tensors}
    assert shapes["token_embd.weight"] == [32, len(tokens)]  # ggml's order: columns first
    assert shapes["output.weight"] == [32, len(tokens)]
    assert shapes["blk.1.attn_k.weight"] == [32, 16]  # two KV heads of 8
    assert shapes["blk.1.ffn_down.weight"] == [64, 32]
    assert len(shapes) == 3 + 9 * TINY.layers


def test_the_vocabulary_takes_agent_prompts_several_characters_a_token() -> None:
    merges = lm.learn_merges(lm.corpus(), 3000)
    assert merges == lm.learn_merges(lm.corpus(), 3000)
    prompt = "\n".join(str(m["content"]) for m in first_messages("test", 8000))
    assert lm.chars_per_token(prompt, merges) > 4
    assert lm.chars_per_token(lm._SAMPLE, merges) > 2
    text = 'héllo <tool_call>\n{"name": "lookup"} \x00\t  end'
    assert "".join(lm.tokenize(text, merges)) == "".join(lm.BYTE_CHARS[b] for b in text.encode())


# --- the real llama-server, where one is found --------------------------------------------------

LLAMA_SERVER = lm.find_llama_server()
needs_llama_server = pytest.mark.skipif(
    LLAMA_SERVER is None,
    reason="no llama-server: set LLAMA_SERVER, put it on PATH, or build it with tools/llamacpp.sh",
)


@pytest.fixture
def llama_server(tmp_path: Path):
    assert LLAMA_SERVER is not None
    model = lm.write(tmp_path / "tiny.gguf", TINY)
    port = free_port()
    log = (tmp_path / "llama-server.log").open("w")
    args = [LLAMA_SERVER, "-m", str(model), "--jinja", "--parallel", "2", "-c", "4096", "-t", "1"]
    args += ["--metrics", "--host", "127.0.0.1", "--port", str(port)]
    process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, (tmp_path / "llama-server.log").read_text()[-3000:]
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "llama-server not healthy within 60 s"
            time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


@needs_llama_server
def test_llama_server_serves_a_chat_turn_with_tools_and_reuses_its_prefix_in_the_next(
    llama_server: str,
) -> None:
    url = llama_server
    with httpx.Client(base_url=url, timeout=60) as client:
        first = first_messages("llama-server", 3000)
        r = client.post("/v1/chat/completions", json={"messages": first, "tools": TOOLS, "max_tokens": 8})
        assert r.status_code == 200, r.text
        one = r.json()
        assert one["choices"][0]["message"]["role"] == "assistant"
        arguments = json.dumps({"query": "river delta"})
        call = {"id": "call_0", "type": "function", "function": {"name": "lookup", "arguments": arguments}}
        second = [
            *first,
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_0", "content": "Lookup result for 'river delta': a mouth"},
        ]
        r = client.post("/v1/chat/completions", json={"messages": second, "tools": TOOLS, "max_tokens": 8})
        assert r.status_code == 200, r.text
        two = r.json()
        assert two["usage"]["prompt_tokens"] > one["usage"]["prompt_tokens"]
        assert two["usage"]["prompt_tokens_details"]["cached_tokens"] >= one["usage"]["prompt_tokens"] - 1

        # The template puts the tools first and each turn after the last: a stable prefix.
        p1 = client.post("/apply-template", json={"messages": first, "tools": TOOLS}).json()["prompt"]
        p2 = client.post("/apply-template", json={"messages": second, "tools": TOOLS}).json()["prompt"]
        assert p1.startswith("<|im_start|>system\n# Tools") and json.dumps(TOOLS[0])[:20] in p1
        assert p2.startswith(p1)
        assert '<tool_call>\n{"name": "lookup", "arguments": {"query": "river delta"}}\n</tool_call>' in p2

        # llama.cpp splits and merges text as the merges were learned here.
        merges = lm.learn_merges(lm.corpus(), TINY.merges)
        ids = {t: i for i, t in enumerate(lm.vocabulary(merges))}
        text = str(first[1]["content"]) + ' {"query": "héllo"}\n\tend'
        ours = [ids[t] for t in lm.tokenize(text, merges)]
        assert client.post("/tokenize", json={"content": text}).json()["tokens"] == ours

        props = client.get("/props").json()
        assert props["total_slots"] == 2
        assert props["chat_template_caps"]["supports_tools"] is True
        assert len(client.get("/slots").json()) == 2
        assert "llamacpp:prompt_tokens_total" in client.get("/metrics").text


@needs_llama_server
async def test_the_prober_reads_a_real_llama_server_s_load_slots_kv_and_prompt_cache(
    llama_server: str,
) -> None:
    url = llama_server
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        messages = first_messages("llama-server", 3000)
        for _ in range(2):  # the second turn finds the first one's prompt in its slot
            r = await client.post(
                "/v1/chat/completions", json={"messages": messages, "tools": TOOLS, "max_tokens": 4}
            )
            assert r.status_code == 200, r.text
        used = r.json()["usage"]
        slots = (await client.get("/slots")).json()
        replica = config.Replica(name="l", url=url, models=["m"], metrics="llamacpp")
        probed = await probe(client, replica, 10.0, time.monotonic, read_kv=True)
    assert (probed.healthy, probed.running, probed.waiting) == (True, 0, 0)
    # Its slots, and its KV as their contexts summed (what `-c 4096 --parallel 2` gives each).
    assert probed.kv_slots == 2 and probed.kv_tokens == sum(s["n_ctx"] for s in slots) > 0
    # Its prompt-cache counters since it started: both turns' prompts, and the second's from its cache.
    assert probed.prompt_tokens == 2 * used["prompt_tokens"]
    assert probed.cached_tokens == used["prompt_tokens_details"]["cached_tokens"] > 0
    # llama.cpp says nothing of its host cache: the probe has no word on it.
    assert probed.host_cache is None
