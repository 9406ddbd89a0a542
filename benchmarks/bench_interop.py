"""Import/export at GPT-2-small shape: time, memory and logit agreement with transformers and TransformerLens.

A random GPT2LMHeadModel (12 x 12 heads, d_model 768, vocab 50257; transformers' own init,
biases and LayerNorms perturbed so they matter) is written with save_pretrained; then qkov
imports the directory (safetensors + JSON only), compares logits with transformers on random
tokens, exports to TransformerLens (in memory and as a .safetensors file) and to a Hugging
Face directory, and reloads each. Needs transformers and transformer-lens (pip install -e '.[dev]').

    python3 benchmarks/bench_interop.py
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from peak import peak_mib  # this process's own peak (ru_maxrss counts a forked parent's)


def main() -> None:
    import torch
    import transformers

    from qkov.io import load_hf, load_tl, save_hf, save_tl, to_hooked

    torch.manual_seed(0)
    transformers.logging.set_verbosity_error()
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config()).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("bias") or ".ln_" in name:
                p.add_(torch.randn_like(p) * 0.1)
    tokens = torch.randint(0, 50257, (4, 128))
    with torch.no_grad():
        expected = hf(tokens).logits
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "gpt2"
        hf.save_pretrained(src)
        del hf
        t0 = time.perf_counter()
        model = load_hf(src)
        t_import = time.perf_counter() - t0
        with torch.no_grad():
            d_hf = float((model(tokens) - expected).abs().max())
        t0 = time.perf_counter()
        hooked = to_hooked(model)
        t_tl = time.perf_counter() - t0
        with torch.no_grad():
            d_tl = float((hooked(tokens) - expected).abs().max())
        del hooked
        t0 = time.perf_counter()
        save_tl(model, Path(tmp) / "gpt2.safetensors")
        back = load_tl(Path(tmp) / "gpt2.safetensors")
        t_file = time.perf_counter() - t0
        same_tl = all(torch.equal(v, back.state_dict()[k]) for k, v in model.state_dict().items())
        del back
        t0 = time.perf_counter()
        save_hf(model, Path(tmp) / "out")
        again = transformers.GPT2LMHeadModel.from_pretrained(Path(tmp) / "out").eval()
        t_export = time.perf_counter() - t0
        with torch.no_grad():
            d_round = float((again(tokens).logits - expected).abs().max())
    peak = peak_mib()
    print(f"GPT-2-small shape, {model.num_parameters():,} parameters, float32, logits over 4 x 128 random tokens")
    print(
        f"  load_hf (save_pretrained directory)             {t_import:6.2f} s   max |logit - transformers| {d_hf:.1e}"
    )
    print(f"  to_hooked (TransformerLens object)              {t_tl:6.2f} s   max |TL logit - transformers| {d_tl:.1e}")
    print(f"  save_tl + load_tl (.safetensors, config inside) {t_file:6.2f} s   weights identical: {same_tl}")
    print(f"  save_hf + GPT2LMHeadModel.from_pretrained       {t_export:6.2f} s   max |logit diff| {d_round:.1e}")
    print(f"  peak RSS of the whole run: {peak:,.0f} MiB")


if __name__ == "__main__":
    main()
