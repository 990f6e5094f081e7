"""Trajectory pages (molt/view.py) in headless Chromium: segments, images, tool calls and gated tokens of hand-written
records, the token budget, the page steps, and the per-token actor log-probs the train step keeps on every actor
layout. The pages of a real run (rows, a coloured rollout, filters, a screenshot, `molt-view`) are read in
tests/test_loop.py, from the run its other tests read."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from html.parser import HTMLParser
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from molt import view
from molt.actor.actor import Actor
from molt.actor.group import init_distributed, rank_actor
from molt.config import FsdpConfig, TrainConfig
from molt.net import free_port
from tests.actor.test_parallel import segments
from tests.ranks import spawn

MOLT_VIEW = Path(sys.executable).parent / "molt-view"  # the console script (pyproject [project.scripts])
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@pytest.fixture(scope="session")
def chromium() -> str:
    """/usr/bin/chromium, installed from Debian's packages when missing (as root, with apt-get)."""
    if not shutil.which("chromium"):
        if os.geteuid() != 0 or not shutil.which("apt-get"):
            pytest.skip("Chromium is not installed and cannot be (needs root and apt-get)")
        out = subprocess.run("apt-get update -qq && apt-get install -y -qq --no-install-recommends chromium",
                             shell=True, capture_output=True, text=True, timeout=900)
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return shutil.which("chromium")


def browse(chromium: str, page: Path, fragment: str = "", *flags: str) -> str:
    """Open page#fragment in headless Chromium with a fresh profile; its DOM after the page's script ran."""
    with tempfile.TemporaryDirectory(prefix="chromium") as profile:
        out = subprocess.run([chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *(flags or ["--dump-dom"]),
                              page.as_uri() + fragment], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


class Dom(HTMLParser):
    """The element tree of a dumped DOM: enough to find elements by tag, id and class and read their text."""

    VOID = {"meta", "br", "input", "img", "link", "hr"}

    def __init__(self, html: str):
        super().__init__()
        self.root = {"tag": "", "attrs": {}, "children": [], "text": ""}
        self.stack = [self.root]
        self.feed(html)

    def handle_starttag(self, tag, attrs):
        node = {"tag": tag, "attrs": dict(attrs), "children": [], "text": ""}
        self.stack[-1]["children"].append(node)
        if tag not in self.VOID:
            self.stack.append(node)

    def handle_endtag(self, tag):
        while len(self.stack) > 1 and self.stack.pop()["tag"] != tag:
            pass

    def handle_data(self, data):
        for node in self.stack:
            node["text"] += data

    def find(self, tag=None, cls=None, id=None, under=None):
        """Every element below `under` (the root) with this tag, class and id."""
        out, todo = [], list((under or self.root)["children"])
        while todo:
            n = todo.pop(0)
            classes = (n["attrs"].get("class") or "").split()
            if (tag in (None, n["tag"])) and (cls is None or cls in classes) and id in (None, n["attrs"].get("id")):
                out.append(n)
            todo += n["children"]
        return out

    def one(self, **kw):
        found = self.find(**kw)
        assert len(found) == 1, (kw, len(found))
        return found[0]


def page_rollouts(page: Path) -> list[dict]:
    return json.loads(re.search(r'<script type="application/json" id="data">(.*?)</script>', page.read_text(),
                                re.S).group(1))["rollouts"]


def hand_written_records() -> list[dict]:
    """A compacted two-segment rollout with an image, a tool call and a tool result; one gated token."""
    def seg(ids, mask, weights=None, images=()):
        return {"token_ids": ids, "loss_mask": mask, "logprobs": [-0.5 * m for m in mask],
                "versions": [3 if m else -1 for m in mask], "advantage": 0.7,
                "actor_logprobs": [-0.5 * m for m in mask], "routed_experts": None, "images": list(images),
                "is_weights": weights or [float(m) for m in mask]}
    first = seg([1, 2, 3, 10, 11, 12, 4, 13, 14, 5, 20], [0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 1],
                images=[{"offset": 1, "length": 2, "sha256": "ab" * 32, "bytes": 1234}])
    second = seg([6, 20, 21], [0, 1, 1], weights=[0.0, 0.0, 1.0])
    return [{"step": 4, "group_id": "g0", "rollout_id": "g0/0", "reward": 1.0, "status": "ok", "error": "",
             "info": {"turns": 2.0}, "segments": [first, second]},
            {"step": 4, "group_id": "g0", "rollout_id": "g0/1", "reward": 0.0, "status": "failed",
             "error": "agent raised", "info": {}, "segments": []}]


PIECES = {1: "<|im_start|>user\nlook: ", 2: "<image>", 3: "<image>", 10: "<tool_call>", 11: '{"name": "ls"}',
          12: "</tool_call>", 4: "<|im_start|>user\n", 13: "<tool_response>", 14: "a.txt", 5: "</tool_response>",
          20: "done", 6: "summary: ", 21: "!"}


def test_page_shows_segments_images_tool_calls_and_gated_tokens(chromium, tmp_path):
    page = tmp_path / "step_0000004.html"
    page.write_text(view.build_page(hand_written_records(), 4, lambda ids: [PIECES[i] for i in ids]))
    dom = Dom(browse(chromium, page, "#r=g0%2F0&s=w"))
    shown = dom.one(id="view")
    labels = [b["text"] for b in dom.find("b", under=shown)]
    assert labels == ["prompt", "tool call", "tool result", "assistant", "prompt", "assistant"], labels
    assert dom.one(cls="seg", under=shown)["text"].startswith("segment 2: the context was compacted")
    image = dom.one(cls="img", under=shown)["text"]
    assert "2 tokens" in image and "1234 bytes" in image and "abababababab" in image and "<image>" not in shown["text"]
    gated = dom.find("span", cls="gated", under=shown)
    assert [t["text"] for t in gated] == ["done"], "the second segment's first generated token is gated"
    assert len(dom.find("tr", under=dom.one(id="rows"))) == 2


def test_page_keeps_every_row_and_the_tokens_of_the_most_telling_rollouts_within_its_budget():
    records = [{"step": 0, "group_id": "g", "rollout_id": f"g/{i}", "reward": float(i), "status": "ok", "error": "",
                "info": {}, "segments": [{"token_ids": [7] * 10, "loss_mask": [0] * 5 + [1] * 5,
                                          "logprobs": [0.0] * 5 + [-1.0] * 5, "versions": [-1] * 5 + [0] * 5,
                                          "advantage": 0.0, "images": []}]} for i in range(6)]
    records[3]["status"] = "failed"
    rows = view.page_data(records, 0, max_tokens=30)["rollouts"]
    assert len(rows) == 6
    assert [r["id"] for r in rows if r["segs"]] == ["g/0", "g/3", "g/5"], "the failed, the best, the worst"
    assert all(r["segs"] for r in view.page_data(records, 0)["rollouts"])


def test_pages_follow_eval_every_unless_view_every_says_otherwise():
    def cfg(every, ev):
        return SimpleNamespace(view=SimpleNamespace(every=every), eval=SimpleNamespace(every=ev),
                               train=SimpleNamespace(steps=10))

    assert [s for s in range(10) if view.due(cfg(None, 4), s)] == [0, 4, 8, 9]
    assert [s for s in range(10) if view.due(cfg(None, 0), s)] == [9]
    assert [s for s in range(10) if view.due(cfg(3, 4), s)] == [0, 3, 6, 9]
    assert not any(view.due(cfg(0, 4), s) for s in range(10))


TRAIN = TrainConfig(row_tokens=16, micro_batch_rows=1, lr=1e-3)


def _rank(rank, world, port, model_dir, fsdp, out):
    torch.set_num_threads(1)
    actor = rank_actor(model_dir, TRAIN, fsdp, init_distributed(rank, world, port, gpu=False))
    segs, adv = segments(4)
    actor.train_step(segs, adv, 1.0, True)
    if rank == 0:
        torch.save(actor.kept_logprobs(), out)
    dist.barrier()
    dist.destroy_process_group()


def test_kept_logprobs_are_the_losss_own_on_one_rank_and_across_data_and_context_parallel_ranks(tmp_path):
    """One rank: the kept log-probs are the actor's log-probs before the step on generated tokens, 0 elsewhere; and
    two context-parallel ranks (each row's columns split between them, in the next-token alignment) keep the same.
    (Data-parallel ranks hold whole rows: the same gather, without the alignment; not run here, for time.)"""
    from molt.assets import ensure_model

    model_dir = str(ensure_model(tmp_path / "tiny", "tiny"))
    segs, adv = segments(4)
    actor = Actor(model_dir, TRAIN)
    before = actor.logprobs(segs)
    actor.train_step(segs, adv, 1.0, True)
    one = actor.kept_logprobs()
    for k, b, s in zip(one, before, segs):
        assert k == pytest.approx([x * m for x, m in zip(b, s.loss_mask)], abs=1e-5)
    actor.train_step(segs, adv)
    assert actor.kept_logprobs() is None
    out = tmp_path / "kept.pt"
    spawn(_rank, args=(2, free_port(), model_dir, FsdpConfig(cp_size=2), str(out)), nprocs=2)
    for a, b in zip(torch.load(out), one):
        assert a == pytest.approx(b, abs=1e-5)
