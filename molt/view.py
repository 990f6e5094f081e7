"""Trajectory pages: what the policy did in one step, as one self-contained HTML page (inline CSS and script, no
network: a Content-Security-Policy forbids every load).

    molt-view outputs/quickstart/<time>                     # the run's pages: list them, the newest last
    molt-view outputs/quickstart/<time> --step 40           # rebuild step 40's page from the run's dump
    molt-view DUMP_DIR --step 40 --tokenizer assets/tiny    # from a dump alone (train.dump_rollouts)

One row per rollout (group, reward, advantage, status and reason, turns, segments, tokens, staleness, mismatch); a
rollout opens as its token stream, prompt and observation tokens plain, generated tokens coloured by the signal
the reader picks: advantage, behaviour log-prob, the actor's log-prob minus the engine's, the importance weight
(struck through where the gate masked it), weight version. The loop writes <output_dir>/view/step_N.html on the
steps `due` names, from the same records the dump holds (README "Seeing trajectories").
"""
from __future__ import annotations

import argparse
import base64
import json
import webbrowser
from functools import cache
from pathlib import Path

import numpy as np

from molt.config import ViewConfig


def due(cfg, step: int) -> bool:
    """A page this step: every view.every steps (None: at eval.every's) and at the last; view.every=0: never."""
    every = cfg.eval.every if cfg.view.every is None else cfg.view.every
    if cfg.view.every == 0:
        return False
    return step + 1 == cfg.train.steps or bool(every) and step % every == 0


def records(groups, failed, advantages, step: int, actor_logprobs=None, is_correction=None) -> list[dict]:
    """The step's rollouts in the dump's format (README "Outputs"): the trained ones with their advantages and, when
    the train step kept them, the actor's log-probs and the IS weights its loss applied; then the failed ones."""
    trained = [s for g in groups for r in g.rollouts for s in r.segments]
    weights = iter(importance_weights(trained, actor_logprobs, is_correction))
    adv, kept = iter(advantages), iter(actor_logprobs or [])
    out = [rollout_record(r, step, [segment_record(s, next(adv), next(kept, None), next(weights))
                                    for s in r.segments]) for g in groups for r in g.rollouts]
    return out + [rollout_record(r, step, [segment_record(s) for s in r.segments]) for r in failed]


def rollout_record(r, step: int, segments: list[dict]) -> dict:
    return {"step": step, "group_id": r.group_id, "rollout_id": r.rollout_id, "reward": r.reward, "status": r.status,
            "error": r.error, "info": r.info, "segments": segments}


def segment_record(s, advantage=None, actor_logprobs=None, is_weights=None) -> dict:
    """One segment's columns; advantage, actor_logprobs and is_weights are None where nothing was trained or kept."""
    return {"token_ids": s.token_ids, "loss_mask": s.loss_mask, "logprobs": s.logprobs, "versions": s.versions,
            "advantage": advantage, "actor_logprobs": actor_logprobs, "is_weights": is_weights,
            "routed_experts": None if s.routed_experts is None else s.routed_experts.tolist(),
            "images": [im.record() for im in s.images]}


def importance_weights(segments, actor_logprobs, cfg) -> list[list[float] | None]:
    """Per segment and token, the IS weight the train step's loss applied (0.0 where the gate masked it or off the
    mask): the loss's own function (molt/algo/correction.py) on the same float32 log-probs, a segment being one
    sequence, all segments in one call. None without kept log-probs or with is_correction.level=off."""
    if actor_logprobs is None or cfg is None or cfg.level == "off" or not segments:
        return [None] * len(segments)
    import torch

    from molt.algo.correction import is_weights

    lengths = [len(s.token_ids) for s in segments]
    cat = lambda xs: torch.from_numpy(np.concatenate([np.asarray(x, np.float32) for x in xs]))[None]  # noqa: E731
    mask = cat(s.loss_mask for s in segments)  # (1, N)
    log_ratio = (cat(actor_logprobs) - cat(s.logprobs for s in segments)) * mask  # (1, N), as the Objective's
    seg = torch.repeat_interleave(torch.arange(len(segments)), torch.tensor(lengths))[None]  # (1, N)
    weight, _ = is_weights(log_ratio, mask, seg, cfg, 1, 1)
    return [w.tolist() for w in weight[0].split(lengths)]


def columns(s: dict) -> dict:
    """A dump segment's columns as arrays; the signals only at its generated tokens."""
    mask, behaviour = np.asarray(s["loss_mask"], bool), np.asarray(s["logprobs"], np.float64)
    adv, actor, w = s.get("advantage"), s.get("actor_logprobs"), s.get("is_weights")  # absent in older dumps
    return {"ids": np.asarray(s["token_ids"], np.int64), "mask": mask, "lp": behaviour[mask],
            "adv": np.asarray(adv, np.float64)[mask] if isinstance(adv, list) else adv,
            "d": None if actor is None else (np.asarray(actor, np.float64) - behaviour)[mask],
            "w": None if w is None else np.asarray(w, np.float64)[mask],
            "v": np.asarray(s["versions"], np.int64)[mask], "images": s.get("images", [])}


def summary(r: dict, cols: list[dict]) -> dict:
    """A rollout's row: who it is, how it went, its sizes; advantage, staleness and mismatch over its generated
    tokens (None where a segment has none of them)."""
    gen = sum(len(c["lp"]) for c in cols)

    def mean(xs):
        return round(float(np.mean(np.concatenate(xs))), 7) if gen and len(xs) == len(cols) else None

    return {"id": r["rollout_id"], "group": r["group_id"], "reward": r["reward"], "status": r["status"],
            "error": r.get("error", ""), "turns": r["info"].get("turns"), "nsegs": len(cols), "gen": gen,
            "tokens": sum(len(c["ids"]) for c in cols),
            "adv": mean([np.broadcast_to(c["adv"], c["lp"].shape) for c in cols if c["adv"] is not None]),
            "stale": r["step"] - int(min(c["v"].min() for c in cols if len(c["v"]))) if gen else None,
            "mismatch": mean([np.abs(c["d"]) for c in cols if c["d"] is not None])}


def shown(rows: list[dict], budget: int) -> set[str]:
    """The rollouts whose tokens go on the page, at most `budget` tokens in all (0: all): the failed first, then in
    turn the best and the worst reward, the most mismatched and the longest."""
    if not budget:
        return {r["id"] for r in rows}
    orders = [sorted(rows, key=key) for key in (lambda r: -r["reward"], lambda r: r["reward"],
                                                 lambda r: -(r["mismatch"] or 0.0), lambda r: -r["tokens"])]
    picked, used = set(), 0
    for r in [r for r in rows if r["status"] == "failed"] + [r for tier in zip(*orders) for r in tier]:
        if r["id"] not in picked and used + r["tokens"] <= budget:
            picked.add(r["id"])
            used += r["tokens"]
    return picked


def b64(x, dtype: str) -> str:
    return base64.b64encode(np.ascontiguousarray(x, dtype).tobytes()).decode()


def runs(x: np.ndarray) -> list[list[int]]:
    """Run-length code of a 1-D array: [[value, count], ...]."""
    starts = np.flatnonzero(np.r_[True, x[1:] != x[:-1]]) if len(x) else np.zeros(0, np.int64)
    return [[int(x[i]), int(n)] for i, n in zip(starts, np.diff(np.r_[starts, len(x)]))]


def encode(c: dict, ids: str) -> dict:
    """A segment on the page: ids and float signals as base64 little-endian typed arrays (5.3 characters a value,
    exact float32, fast to write and to read), mask and versions run-length coded, IS weights only where they are
    not exp(actor - engine) (gated or clipped)."""
    w = None
    if c["w"] is not None:
        off = np.flatnonzero(~np.isclose(c["w"], np.exp(c["d"]), rtol=1e-5, atol=0.0))
        w = [off.tolist(), c["w"][off].round(6).tolist()]
    return {"ids": b64(c["ids"], ids), "mask": runs(c["mask"].astype(np.int64)), "v": runs(c["v"]),
            "lp": b64(c["lp"], "<f4"), "d": None if c["d"] is None else b64(c["d"], "<f4"), "w": w,
            "adv": b64(c["adv"], "<f4") if isinstance(c["adv"], np.ndarray) else c["adv"], "images": c["images"]}


def scales(cols: list[dict], step: int) -> dict[str, float]:
    """Per signal, the largest size among the page's generated tokens (1 if none): colours are relative to it."""
    def top(values) -> float:
        return float(max((np.abs(v).max() for v in values if v is not None and np.size(v)), default=0.0)) or 1.0

    ratios = [np.log(c["w"][c["w"] > 0]) if c["w"] is not None else c["d"] for c in cols]
    return {"adv": top(c["adv"] for c in cols), "lp": top(c["lp"] for c in cols), "d": top(c["d"] for c in cols),
            "w": top(ratios), "v": top(step - c["v"] for c in cols)}


def page_data(records: list[dict], step: int, decode=None, max_tokens: int = 0) -> dict:
    """Everything the page shows: a row per rollout, the tokens of those within max_tokens (0: all), and the text of
    each token id they hold, decoded one id at a time (a token's own text, for colouring; a character split over
    tokens shows as U+FFFD)."""
    cols = [[columns(s) for s in r["segments"]] for r in records]
    rows = [summary(r, c) for r, c in zip(records, cols)]
    keep = shown(rows, max_tokens)
    kept = [c for row, cs in zip(rows, cols) if row["id"] in keep for c in cs]
    ids = np.unique(np.concatenate([c["ids"] for c in kept] or [np.zeros(0, np.int64)]))
    dtype = "<u2" if not len(ids) or ids.max() < 2 ** 16 else "<u4"
    for row, cs in zip(rows, cols):
        row["segs"] = [encode(c, dtype) for c in cs] if row["id"] in keep else None
    texts = decode(ids.tolist()) if decode else [f"[{i}]" for i in ids.tolist()]
    return {"step": step, "ids": dtype[-1], "scale": scales(kept, step), "rollouts": rows,
            "pieces": dict(zip(map(str, ids.tolist()), texts))}


def build_page(records: list[dict], step: int, decode=None, max_tokens: int = 0) -> str:
    """The page of one step's records (dump format); decode: ids -> one text per id (None: ids are shown)."""
    data = json.dumps(page_data(records, step, decode, max_tokens), separators=(",", ":")).replace("<", "\\u003c")
    return PAGE.replace("__STEP__", str(step)).replace("__DATA__", data)


@cache
def tokenizer_decode(path: str):
    """ids -> the text of each alone, with the model's tokenizer (loaded once per process)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    return lambda ids: tok.batch_decode([[i] for i in ids])


def write(out_dir: str | Path, records: list[dict], step: int, tokenizer: str | None = None,
          max_tokens: int = 0) -> Path:
    """Write <out_dir>/step_N.html and return its path."""
    path = Path(out_dir) / f"step_{step:07d}.html"
    path.parent.mkdir(parents=True, exist_ok=True)
    decode = tokenizer_decode(str(tokenizer)) if tokenizer else None
    path.write_text(build_page(records, step, decode, max_tokens))
    return path


def read_dump(path: str | Path, step: int | None = None) -> tuple[list[dict], int]:
    """The records of one step of a dump (a rollouts.jsonl or its directory; None: the last step) and that step."""
    path, chosen, want = Path(path), [], step
    with open(path / "rollouts.jsonl" if path.is_dir() else path) as f:
        for line in f:  # one line at a time: a long run's dump need not fit in memory
            r = json.loads(line)
            if want is None and (step is None or r["step"] > step):  # a later step: the last one so far
                step, chosen = r["step"], []
            if r["step"] == step:
                chosen.append(r)
    if not chosen:
        raise SystemExit(f"molt-view: no rollouts of step {step} in {path}")
    return chosen, step


def run_sources(run_dir: Path) -> tuple[str | None, str | None]:
    """(dump directory, model directory) of a run directory, from its Hydra config (.hydra/config.yaml)."""
    from omegaconf import OmegaConf

    from molt.config import register

    register()  # the ${repo:} resolver the paths use
    cfg = OmegaConf.load(run_dir / ".hydra" / "config.yaml")
    return OmegaConf.select(cfg, "train.dump_rollouts"), OmegaConf.select(cfg, "model.path")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="molt-view", description=__doc__.splitlines()[0])
    ap.add_argument("source", help="a run directory (outputs/<name>/<time>), a dump directory or its rollouts.jsonl")
    ap.add_argument("--step", type=int, help="build this step's page from the dump (default for a dump: its last)")
    ap.add_argument("--tokenizer", help="model directory whose tokenizer decodes the ids (default: the run's model)")
    ap.add_argument("--out", help="where the page goes (default: <run>/view or <dump directory>/view)")
    ap.add_argument("--max-tokens", type=int, default=ViewConfig.max_tokens, help="tokens on the page (0: all)")
    ap.add_argument("--open", action="store_true", help="open the (last) page in the default browser")
    a = ap.parse_args(argv)
    src = Path(a.source)
    if (src / ".hydra" / "config.yaml").exists():  # a run directory: its pages, or one rebuilt from its dump
        dump, model = run_sources(src)
        out = src / "view"
        pages = sorted(out.glob("step_*.html")) if a.step is None else []
        if not pages and not dump:
            what = "no page and no dump" if a.step is None else f"no dump to build step {a.step} from"
            raise SystemExit(f"molt-view: {src} has {what} (run it with train.dump_rollouts=DIR)")
    else:
        dump, model, out, pages = src, None, (src if src.is_dir() else src.parent) / "view", []
    if not pages:
        recs, step = read_dump(dump, a.step)
        pages = [write(a.out or out, recs, step, a.tokenizer or model, a.max_tokens)]
    print("\n".join(str(p.resolve()) for p in pages))
    if a.open:
        webbrowser.open(pages[-1].resolve().as_uri())


PAGE = r"""<!doctype html>
<html><head><meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; style-src 'unsafe-inline'; script-src 'unsafe-inline'">
<title>molt step __STEP__</title>
<style>
body{margin:0;font:13px system-ui,sans-serif;display:flex;flex-direction:column;height:100vh;color:#222}
header{padding:6px 10px;border-bottom:1px solid #ccc;display:flex;gap:14px;align-items:center;flex-wrap:wrap}
main{flex:1;display:flex;min-height:0} #list{width:52%;overflow:auto;border-right:1px solid #ccc;font-size:12px}
#view{flex:1;overflow:auto;padding:6px 12px} table{border-collapse:collapse;width:100%}
th{position:sticky;top:0;background:#f4f4f4;text-align:left} td,th{padding:2px 6px;border-bottom:1px solid #eee}
td.n{text-align:right;font-variant-numeric:tabular-nums} tbody tr{cursor:pointer} tbody tr:hover{background:#f6f6ff}
tr.sel{background:#fff3c4!important} .failed{color:#b00}
.why{max-width:11em;overflow:hidden;text-overflow:ellipsis;white-space:nowrap}
.block{white-space:pre-wrap;word-break:break-word;font:12px/1.5 ui-monospace,monospace;margin:6px 0;padding:2px 6px;
  border-left:4px solid #bbb} .block>b{display:block;font:bold 11px system-ui;color:#666}
.prompt{color:#666} .observation{color:#666;border-color:#6a6}
.tool-result{color:#666;border-color:#c80} .assistant{border-color:#36c} .tool-call{border-color:#a3c}
.g{border-bottom:2px solid #36c} .gated{text-decoration:line-through;background:#bbb!important}
.img{display:inline-block;border:1px dashed #888;padding:0 6px;color:#555;background:#f4f4f4}
.seg{margin-top:12px;border-top:2px dashed #999;color:#666;font-weight:bold} #legend span{padding:0 6px}
</style></head>
<body><header><b>molt · step __STEP__</b><span id="count"></span>
<label>show <select id="filter"><option value="all">all</option><option value="failed">failed</option>
<option value="top">top reward</option><option value="bottom">bottom reward</option>
<option value="long">longest</option><option value="mismatch">most mismatched</option></select></label>
<label>colour by <select id="signal"></select></label><span id="legend"></span></header>
<main><div id="list"><table><thead><tr><th>rollout</th><th>group</th><th>reward</th><th>adv</th><th>status</th>
<th>reason</th><th>turns</th><th>segs</th><th>tokens</th><th>stale</th><th>mismatch</th></tr></thead>
<tbody id="rows"></tbody></table></div><div id="view"></div></main>
<script type="application/json" id="data">__DATA__</script>
<script>
const D = JSON.parse(document.getElementById('data').textContent), $ = id => document.getElementById(id);
const R = D.rollouts, piece = i => D.pieces[i] ?? `[${i}]`, IDS = D.ids === '2' ? Uint16Array : Uint32Array;
const bytes = b => Uint8Array.from(atob(b), c => c.charCodeAt(0)).buffer;
const expand = runs => runs.flatMap(([v, n]) => Array(n).fill(v));
function unpack(s) {  // a segment's base64 and run-length columns as arrays, decoded once, when first shown
  const f32 = b => b == null ? null : new Float32Array(bytes(b));
  return s.u ??= {ids: new IDS(bytes(s.ids)), mask: expand(s.mask), v: expand(s.v), lp: f32(s.lp), d: f32(s.d),
    adv: typeof s.adv === 'string' ? f32(s.adv) : s.adv, w: s.w && new Map(s.w[0].map((k, j) => [k, s.w[1][j]])),
    images: s.images};
}
// signal: [label, value at generated token k of unpacked segment u (null: none), colour kind]
const SIGNALS = {
  adv: ['advantage', (u, k) => u.adv == null ? null : typeof u.adv === 'number' ? u.adv : u.adv[k], 'signed'],
  lp: ['behaviour log-prob', (u, k) => u.lp[k], 'low'],
  d: ['actor − engine log-prob', (u, k) => u.d ? u.d[k] : null, 'signed'],
  w: ['importance weight', (u, k) => u.w ? u.w.get(k) ?? Math.exp(u.d[k]) : u.d ? Math.exp(u.d[k]) : null, 'ratio'],
  v: ['weight version', (u, k) => u.v[k], 'stale']};
const size = {signed: x => Math.abs(x), low: x => -x, ratio: x => x > 0 ? Math.abs(Math.log(x)) : 0,
  stale: x => D.step - x};
function colour(name, x) {  // background: blue up, red down (orange: older), alpha with the size on the page's scale
  const kind = SIGNALS[name][2], t = Math.min(1, size[kind](x) / D.scale[name]);
  const up = kind === 'signed' ? x > 0 : kind === 'ratio' ? x > 1 : false;
  return `rgba(${up ? '33,102,172' : kind === 'stale' ? '230,120,0' : '214,39,40'},${(0.85 * t).toFixed(3)})`;
}
const fmt = x => x == null ? '–' : typeof x !== 'number' ? x
  : Math.abs(x) < 1e-2 && x ? x.toExponential(1) : +x.toFixed(3);
const ORDER = {all: () => R, failed: () => R.filter(r => r.status === 'failed'),
  top: () => [...R].sort((a, b) => b.reward - a.reward), bottom: () => [...R].sort((a, b) => a.reward - b.reward),
  long: () => [...R].sort((a, b) => b.tokens - a.tokens),
  mismatch: () => R.filter(r => r.mismatch != null).sort((a, b) => b.mismatch - a.mismatch)};
function state() { return Object.fromEntries(new URLSearchParams(location.hash.slice(1))); }
function go(change) { location.hash = new URLSearchParams({...state(), ...change}).toString(); }
function rows(st) {
  const list = (ORDER[st.f] || ORDER.all)(), body = $('rows');
  body.replaceChildren(...list.map(r => {
    const tr = document.createElement('tr');
    tr.dataset.id = r.id; tr.className = r.status === 'failed' ? 'failed' : '';
    for (const [v, cls] of [[r.id], [r.group], [fmt(r.reward), 'n'], [fmt(r.adv), 'n'], [r.status], [r.error, 'why'],
        [fmt(r.turns), 'n'], [r.nsegs, 'n'], [`${r.gen}/${r.tokens}`, 'n'], [fmt(r.stale), 'n'],
        [fmt(r.mismatch), 'n']]) {
      const td = tr.insertCell(); td.textContent = v ?? ''; td.title = v ?? ''; if (cls) td.className = cls; }
    tr.onclick = () => go({r: r.id});
    return tr; }));
  $('count').textContent = `${list.length} of ${R.length} rollouts`;
  return list;
}
function kindOf(mask, text, first) {
  if (mask === 1) return /<tool_call>|<function=/.test(text) ? 'tool call' : 'assistant';
  if (first) return 'prompt';
  return /<tool_response>|<\|im_start\|>tool|"role": ?"tool"/.test(text) ? 'tool result' : 'observation';
}
function token(u, k, g, name) {  // generated token k (the g-th) of u: coloured, every signal in its title
  const e = document.createElement('span'), x = SIGNALS[name][1](u, g);
  e.className = 'g'; e.textContent = piece(u.ids[k]);
  if (x != null) e.style.background = colour(name, x);
  if (name === 'w' && u.w && u.w.get(g) === 0) e.classList.add('gated');
  e.title = `id ${u.ids[k]}` + Object.values(SIGNALS).map(([l, get]) => `\n${l}: ${fmt(get(u, g))}`).join('');
  return e;
}
function segment(s, i, name) {  // blocks of equal mask: prompt and observation text plain, generated tokens coloured
  const u = unpack(s), out = [], images = new Map(u.images.map(im => [im.offset, im]));
  if (i > 0) { const e = document.createElement('div'); e.className = 'seg'; out.push(e);
    e.textContent = `segment ${i + 1}: the context was compacted, a new prompt`; }
  let k = 0, g = 0, first = true;
  while (k < u.ids.length) {
    const m = u.mask[k], parts = [];
    let text = '', plain = '';
    for (; k < u.ids.length && u.mask[k] === m; k++) {
      const im = images.get(k);
      if (im) {
        const e = document.createElement('span'); e.className = 'img';
        e.textContent = `[image: ${im.length} tokens, ${im.bytes} bytes, sha256 ${im.sha256.slice(0, 12)}…]`;
        parts.push(plain, e); plain = ''; k += im.length - 1; continue; }
      const p = piece(u.ids[k]); text += p;
      if (m === 0) plain += p; else parts.push(token(u, k, g++, name));
    }
    const kind = kindOf(m, text, first), block = document.createElement('div'), label = document.createElement('b');
    label.textContent = kind; block.className = 'block ' + kind.replace(' ', '-');
    block.append(label, ...parts, plain); out.push(block); first = false;
  }
  return out;
}
function show(r, name) {
  const head = document.createElement('p');
  head.textContent = `${r.id}: reward ${fmt(r.reward)}, ${r.status}${r.error ? ' (' + r.error + ')' : ''}, ` +
    `${r.gen} generated of ${r.tokens} tokens, ${r.nsegs} segment(s)`;
  if (!r.segs) {
    head.textContent += ' · its tokens are not on this page (view.max_tokens): ' +
      `molt-view DUMP --step ${D.step} --max-tokens 0`;
    return $('view').replaceChildren(head); }
  const s = r.segs.map(unpack).find(u => u.lp.length);
  if (s && SIGNALS[name][1](s, 0) == null)
    head.textContent += ` · no ${SIGNALS[name][0]} for this rollout (not kept this step, or not trained)`;
  $('view').replaceChildren(head, ...r.segs.flatMap((s, i) => segment(s, i, name)));
}
function render() {
  const st = state(), name = SIGNALS[st.s] ? st.s : 'adv', kind = SIGNALS[name][2], m = D.scale[name];
  $('filter').value = ORDER[st.f] ? st.f : 'all'; $('signal').value = name;
  const list = rows(st), r = R.find(x => x.id === st.r) || list[0];
  const ends = {signed: [-m, m], low: [-m, 0], ratio: [Math.exp(-m), Math.exp(m)], stale: [D.step - m, D.step]}[kind];
  $('legend').replaceChildren(...ends.map(x => { const e = document.createElement('span');
    e.textContent = kind === 'ratio' ? `exp(${fmt(Math.log(x))})` : fmt(x); e.style.background = colour(name, x);
    return e; }));
  for (const tr of $('rows').rows) tr.classList.toggle('sel', tr.dataset.id === r?.id);
  if (r) show(r, name); else $('view').textContent = 'no rollout to show';
}
$('signal').append(...Object.entries(SIGNALS).map(([k, [l]]) => new Option(l, k)));
$('filter').onchange = e => go({f: e.target.value}); $('signal').onchange = e => go({s: e.target.value});
window.onhashchange = render; render();
</script></body></html>
"""
