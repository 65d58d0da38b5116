"""A small deterministic GGUF model for llama.cpp's `llama-server`, written with the `gguf` package.

The benchmarks against a real llama.cpp need a model that a 2-core CPU machine serves at a
useful speed and that needs no download: this writes one. Llama architecture, random weights
from a fixed seed (numpy; float16 matrices, float32 norms), so the same options write the same
bytes. Its replies are random text; what matters is that llama-server loads it, tokenizes agents'
prompts into a realistic number of tokens, caches their prefixes in its slots and takes as long
over a prompt as a small real model does on a GPU over a long one.

The tokenizer is GPT-2's byte-level BPE (`tokenizer.ggml.model = "gpt2"`, pre-tokenizer
`"gpt-2"`): the 256 byte tokens, so that any text tokenizes, then merges learned here from a
fixed corpus (a passage of English about tools and agents, some JSON and code, and the
load generator's own prompts, tools and tool answers), then the specials `<|endoftext|>` (BOS,
padding), `<|im_start|>` and `<|im_end|>` (EOS). Prompts of the load generator come to about
7 characters a token, English prose outside the corpus to about 3 (`chars_per_token`).

The chat template (`tokenizer.chat_template`, Jinja) is ChatML with the tools at the top of the
prompt, Qwen 2.5's layout: a system turn listing each tool as JSON, then every message in order,
assistant `tool_calls` as `<tool_call>{"name": ..., "arguments": ...}</tool_call>` and `tool`
messages as `<tool_response>` in a user turn. The tools and the earlier turns are then a stable
prefix of each later prompt. llama-server's `--jinja` (its default) derives its tool-call parser
from this template; random replies never contain `<tool_call>` (not a token of its own: several
tokens in a row), so they come back as content.

Measured on one core of the 2-core build machine (a shared machine: the figures vary by some
tens of percent), with the defaults:

    python -m luftpause.bench.llamacpp_model /tmp/luftpause-llamacpp.gguf
    taskset -c 0 llama-server -m /tmp/luftpause-llamacpp.gguf --parallel 4 --ctx-size 16384 -t 1 \\
        --jinja --metrics --port 8090

One chat turn of the load generator's (`first_messages(seed, 17000)`, its two tools, 32 tokens
out; llama-server's own `timings`): 2,702 prompt tokens prefilled in 1.8 s (1,470 tokens/s),
decoded at 69 tokens/s; the next turn, the same messages plus a tool call and its answer
(2,767 tokens), reports `cached_tokens` 2,702 and prefills the other 65 in 0.12 s. With
`--cache-ram 0` (no host prompt cache) added, the server starts and reuses prefixes the same
way (a 575-token turn: 0.32 s, then 234 tokens/s; the next, 575 of its tokens cached). The file
is 22.7 MB, with 930 tokens of vocabulary. A smaller model, `--embd 256 --layers 4 --heads 4
--kv-heads 4 --ff 768`, prefilled the 2,702 tokens in 0.76 s and decoded at 185 tokens/s.

With `tools` in the body, `--jinja` answers 200: llama.cpp's parser, which it derives from the
template, takes the random replies as content (`finish_reason` "length"); nothing needs
turning off. Bytes that are not UTF-8 on their own come back as U+FFFD.

    python -m luftpause.bench.llamacpp_model PATH [--seed 0] [--embd 384] [--layers 6] \\
        [--heads 6] [--kv-heads 6] [--ff 1024] [--merges 3000] [--context 32768]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from luftpause.fake_mcp.server import tool_answer
from luftpause.loadgen.conversation import SYSTEM_PROMPT, TOOLS, context_text, first_messages

BOS = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIALS = (BOS, IM_START, IM_END)

CHAT_TEMPLATE = """\
{%- if tools %}
{{- '<|im_start|>system\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' }}
{{- 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
{%- for tool in tools %}
{{- '\\n' }}{{- tool | tojson }}
{%- endfor %}
{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within ' }}
{{- '<tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'system' or message.role == 'user' %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant' }}
{%- if message.content %}
{{- '\\n' + message.content }}
{%- endif %}
{%- if message.tool_calls %}
{%- for tool_call in message.tool_calls %}
{%- if tool_call.function is defined %}
{%- set tool_call = tool_call.function %}
{%- endif %}
{{- '\\n<tool_call>\\n{"name": "' + tool_call.name + '", "arguments": ' }}
{%- if tool_call.arguments is string %}
{{- tool_call.arguments }}
{%- else %}
{{- tool_call.arguments | tojson }}
{%- endif %}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{%- endif %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}
{{- '<|im_start|>user' }}
{%- endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
{{- '<|im_end|>\\n' }}
{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# English about agents and tools, written for this corpus; with the JSON and code below and the
# load generator's text, it is all the merges are learned from.
_PROSE = """\
An agent is a program that works on a task in turns. In each turn it sends the conversation so
far to a language model, and the model answers with text or with a call to one of the tools it
was given. When the answer is a tool call, the agent runs the tool, appends the call and the
result to the conversation and asks the model again. When the answer is text, the task is done
and the agent reports what it found. The tools are described to the model at the top of the
prompt, with a name, a description and the parameters each one takes, as a JSON schema.
Because the description of the tools and the earlier turns do not change from one turn to the
next, the engine that serves the model can keep the work it did for them and only read the new
part of the prompt. That saves time on long prompts, which are common: an agent that reads
files, searches the web or looks up facts in a database will often send eight thousand
characters or more in every request, and most of them are the same as in the request before.
The scheduler in front of the engines decides which request runs where and when. It should
send a request to the replica that still holds its prefix, wait a little when that replica is
busy, and move the request elsewhere when waiting would cost more than reading the prompt
again. The results of these decisions are measured in seconds to the first token, tokens per
second while the reply is written, and the number of tasks that finish within their deadline.
Please check the facts before you answer, explain the steps you took, and say which sources you
used. If a tool fails, try again once, then report the error and what you would do next.
The user asked for a short summary of the report, a list of the open questions, and the date
of the next meeting. There are three files in the project: the main module, the tests and the
configuration. Read the configuration first, then the tests, then write the change and run them.
"""

_CODE = """\
def handle(request: dict[str, Any]) -> dict[str, Any]:
    \"\"\"Return the response for one request, or an error with its status code.\"\"\"
    if "messages" not in request:
        return {"error": {"message": "missing messages", "code": 400}}
    for message in request["messages"]:
        print(message["role"], len(message.get("content") or ""))
    return {"id": "chatcmpl-1", "object": "chat.completion", "choices": [], "usage": {}}

{"role": "assistant", "content": null, "tool_calls": [{"id": "call_0", "type": "function",
 "function": {"name": "lookup", "arguments": "{\\"query\\": \\"river delta\\"}"}}]}
{"role": "tool", "tool_call_id": "call_0", "content": "Lookup result for 'river delta'"}
{"model": "model", "max_tokens": 256, "stream": true, "temperature": 0.7, "top_p": 0.9}
"""

# GPT-2's pre-tokenizer (`\\p{L}` and `\\p{N}` approximated with the standard library's classes):
# merges never cross these pieces, as llama.cpp's "gpt-2" pre-tokenizer splits text the same way.
_PRE_TOKENIZER = re.compile(r"'s|'t|'re|'ve|'m|'ll|'d| ?[^\W\d_]+| ?\d+| ?(?:[^\s\w]|_)+|\s+(?!\S)|\s+")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map from each byte to a printable character, in which its BPE vocabularies are spelled."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}


BYTE_CHARS = _bytes_to_unicode()


def corpus() -> str:
    """The text the merges are learned from: fixed prose and code, and the load generator's turns."""
    parts = [_PROSE, _CODE, SYSTEM_PROMPT, json.dumps(TOOLS), json.dumps(TOOLS, indent=2)]
    for i in range(8):
        messages = first_messages(f"corpus-{i}", 1500)
        parts.extend(str(m["content"]) for m in messages)
        query = context_text(f"query-{i}", 24)
        parts.append(tool_answer("lookup", query))
        parts.append(tool_answer("deep_search", query))
    parts.append(CHAT_TEMPLATE)
    return "\n".join(parts)


def _spelled(text: str) -> list[str]:
    return ["".join(BYTE_CHARS[b] for b in piece.encode()) for piece in _PRE_TOKENIZER.findall(text)]


def learn_merges(text: str, limit: int) -> list[tuple[str, str]]:
    """Byte-level BPE merges from `text`: at most `limit`, each pair seen at least twice.

    Ties go to the pair that sorts first, so the merges are a function of the text alone.
    """
    words = Counter(_spelled(text))
    symbols = [list(w) for w in words]
    counts = list(words.values())
    pairs: Counter[tuple[str, str]] = Counter()
    where: defaultdict[tuple[str, str], set[int]] = defaultdict(set)
    for i, word in enumerate(symbols):
        for pair in zip(word, word[1:], strict=False):
            pairs[pair] += counts[i]
            where[pair].add(i)
    merges: list[tuple[str, str]] = []
    while len(merges) < limit and pairs:
        best = min(pairs, key=lambda p: (-pairs[p], p))
        if pairs[best] < 2:
            break
        merges.append(best)
        joined = best[0] + best[1]
        for i in sorted(where.pop(best, set())):
            word = symbols[i]
            for pair in zip(word, word[1:], strict=False):
                pairs[pair] -= counts[i]
                if pairs[pair] <= 0:
                    del pairs[pair]
            merged: list[str] = []
            j = 0
            while j < len(word):
                if j + 1 < len(word) and (word[j], word[j + 1]) == best:
                    merged.append(joined)
                    j += 2
                else:
                    merged.append(word[j])
                    j += 1
            symbols[i] = merged
            for pair in zip(merged, merged[1:], strict=False):
                pairs[pair] += counts[i]
                where[pair].add(i)
        pairs.pop(best, None)
    return merges


def tokenize(text: str, merges: list[tuple[str, str]]) -> list[str]:
    """`text` in the vocabulary's tokens, merged as llama.cpp merges them (lowest rank first)."""
    rank = {pair: r for r, pair in enumerate(merges)}
    tokens: list[str] = []
    for piece in _spelled(text):
        word = list(piece)
        while len(word) > 1:
            ranked = [(rank.get(p, len(rank)), k) for k, p in enumerate(zip(word, word[1:], strict=False))]
            r, k = min(ranked)
            if r == len(rank):
                break
            word[k : k + 2] = [word[k] + word[k + 1]]
        tokens.extend(word)
    return tokens


def chars_per_token(text: str, merges: list[tuple[str, str]]) -> float:
    return len(text) / max(len(tokenize(text, merges)), 1)


def find_llama_server() -> str | None:
    """The llama-server that tools/llamacpp.sh would print, without building one: $LLAMA_SERVER,
    then PATH, then its cache ($LUFTPAUSE_CACHE, default ~/.cache/luftpause); None when none is
    there. A $LLAMA_SERVER that names no executable is an error, as it is for the script."""
    named = os.environ.get("LLAMA_SERVER")
    if named:
        if os.path.isfile(named) and os.access(named, os.X_OK):
            return named
        raise FileNotFoundError(f"LLAMA_SERVER={named} is not an executable file")
    on_path = shutil.which("llama-server")
    if on_path:
        return on_path
    cache = Path(os.environ.get("LUFTPAUSE_CACHE") or Path.home() / ".cache" / "luftpause")
    built = cache / "llamacpp" / "bin" / "llama-server"
    return str(built) if os.access(built, os.X_OK) else None


@dataclass(frozen=True)
class Dimensions:
    embd: int = 384
    layers: int = 6
    heads: int = 6
    kv_heads: int = 6
    ff: int = 1024
    merges: int = 3000
    context: int = 32768


def vocabulary(merges: list[tuple[str, str]]) -> list[str]:
    """The tokens by id: the 256 bytes, then each merge's result, then the specials."""
    tokens = [BYTE_CHARS[b] for b in range(256)]
    seen = set(tokens)
    for a, b in merges:
        if a + b not in seen:
            seen.add(a + b)
            tokens.append(a + b)
    return [*tokens, *SPECIALS]


def write(path: str | Path, dims: Dimensions = Dimensions(), seed: int = 0) -> Path:
    """Write the model to `path` and return it; the same dimensions and seed write the same bytes."""
    if dims.embd % dims.heads or dims.heads % dims.kv_heads:
        raise ValueError("embd must divide into heads, and heads into kv_heads")
    path = Path(path)
    merges = learn_merges(corpus(), dims.merges)
    tokens = vocabulary(merges)
    head_dim = dims.embd // dims.heads
    kv_dim = head_dim * dims.kv_heads

    w = gguf.GGUFWriter(path, "llama")
    w.add_name("luftpause-random-llama")
    w.add_context_length(dims.context)
    w.add_embedding_length(dims.embd)
    w.add_block_count(dims.layers)
    w.add_feed_forward_length(dims.ff)
    w.add_head_count(dims.heads)
    w.add_head_count_kv(dims.kv_heads)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(tokens))
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)

    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    types = [gguf.TokenType.NORMAL] * (len(tokens) - len(SPECIALS)) + [gguf.TokenType.CONTROL] * len(SPECIALS)
    w.add_token_types(types)
    w.add_token_merges([f"{a} {b}" for a, b in merges])
    w.add_bos_token_id(tokens.index(BOS))
    w.add_eos_token_id(tokens.index(IM_END))
    w.add_eot_token_id(tokens.index(IM_END))
    w.add_pad_token_id(tokens.index(BOS))
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)

    rng = np.random.default_rng(seed)

    def matrix(rows: int, cols: int) -> np.ndarray:
        # numpy's (rows, cols) is ggml's ne = [cols, rows]: a layer maps cols inputs to rows outputs.
        return (rng.standard_normal((rows, cols), dtype=np.float32) / np.sqrt(cols)).astype(np.float16)

    def ones(n: int) -> np.ndarray:
        return np.ones(n, dtype=np.float32)

    w.add_tensor("token_embd.weight", matrix(len(tokens), dims.embd))
    for i in range(dims.layers):
        w.add_tensor(f"blk.{i}.attn_norm.weight", ones(dims.embd))
        w.add_tensor(f"blk.{i}.attn_q.weight", matrix(dims.embd, dims.embd))
        w.add_tensor(f"blk.{i}.attn_k.weight", matrix(kv_dim, dims.embd))
        w.add_tensor(f"blk.{i}.attn_v.weight", matrix(kv_dim, dims.embd))
        w.add_tensor(f"blk.{i}.attn_output.weight", matrix(dims.embd, dims.embd))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", ones(dims.embd))
        w.add_tensor(f"blk.{i}.ffn_gate.weight", matrix(dims.ff, dims.embd))
        w.add_tensor(f"blk.{i}.ffn_up.weight", matrix(dims.ff, dims.embd))
        w.add_tensor(f"blk.{i}.ffn_down.weight", matrix(dims.embd, dims.ff))
    w.add_tensor("output_norm.weight", ones(dims.embd))
    w.add_tensor("output.weight", matrix(len(tokens), dims.embd))

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m luftpause.bench.llamacpp_model", description=__doc__.split("\n")[0]
    )
    p.add_argument("path", help="where to write the .gguf")
    p.add_argument("--seed", type=int, default=0)
    defaults = Dimensions()
    p.add_argument("--embd", type=int, default=defaults.embd, help="hidden size")
    p.add_argument("--layers", type=int, default=defaults.layers)
    p.add_argument("--heads", type=int, default=defaults.heads)
    p.add_argument("--kv-heads", type=int, default=defaults.kv_heads)
    p.add_argument("--ff", type=int, default=defaults.ff, help="feed-forward size")
    p.add_argument("--merges", type=int, default=defaults.merges, help="at most this many BPE merges")
    p.add_argument("--context", type=int, default=defaults.context, help="the model's trained context")
    args = p.parse_args(argv)
    dims = Dimensions(args.embd, args.layers, args.heads, args.kv_heads, args.ff, args.merges, args.context)
    path = write(args.path, dims, args.seed)
    merges = learn_merges(corpus(), dims.merges)
    prompt = "\n".join(str(m["content"]) for m in first_messages("example", 8000))
    print(
        f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB, {len(vocabulary(merges))} tokens); "
        f"a load-generator prompt is {chars_per_token(prompt, merges):.1f} characters a token, "
        f"English outside the corpus {chars_per_token(_SAMPLE, merges):.1f}"
    )
    return 0


# Text that is not in the corpus, to tell how the vocabulary does on English it was not built from.
_SAMPLE = (
    "The committee reviewed the quarterly budget and asked the engineering team to estimate the "
    "cost of moving the storage cluster to the new data centre before the end of the year. Several "
    "members wanted a written comparison of the options, including the risks of a delayed migration."
)


if __name__ == "__main__":
    raise SystemExit(main())
