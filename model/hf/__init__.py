"""Hugging Face ``transformers`` checkpoints <-> this project's ``Transformer``: one key and config mapping,
used by the export (``python -m pretrain.export --format hf``) and the import (``python -m pretrain.hf_import``).

Architectures (``config.json``'s ``architectures[0]``, else its ``model_type``):

- ``GPT2LMHeadModel`` <-> family ``gpt2``: learned positions, LayerNorm, GELU (tanh), biases; HF keeps
  q/k/v fused in one ``Conv1D`` (``c_attn``, weights stored [in, out]), split and transposed here.
- ``LlamaForCausalLM`` / ``MistralForCausalLM`` / ``Qwen2ForCausalLM`` / ``Qwen3ForCausalLM`` <-> family ``llama``:
  RMSNorm, SwiGLU, RoPE (and its scaling), GQA. Qwen2 has biases on q/k/v only (``model.qkv_bias``),
  Qwen3 RMS-normalises q and k per head (``model.qk_norm``). Mistral's and Qwen2's sliding window is mapped,
  not emulated: the imported model's ``max_seq_len`` is capped at the window, below which sliding-window
  and full causal attention compute the same thing.

The export picks the architecture from the model: GPT-2 for family ``gpt2``; Qwen3 with ``qk_norm``, Qwen2
with ``qkv_bias`` alone, else LLaMA. RoPE scaling maps onto ``rope_parameters`` (transformers 5) and
``rope_scaling`` + ``rope_theta`` (transformers 4); static NTK has no HF type and is written as the plain
RoPE base it amounts to, theta * factor^(d / (d - 2)).

``transformers`` runs full attention only. A model with another attention variant is refused unless the
caller allows it; then config.json says so twice: ``model_type`` becomes ``focused_<type>`` (so
``AutoModelForCausalLM`` refuses it instead of silently running full attention) and ``focused_attention``
holds the variant's settings; the variant's own tensors keep their names under the layer
(``...self_attn.core.*``). The import reads both back.

Every unsupported option is one ``ConfigError`` line naming it.
"""

from model.hf.configs import *  # noqa: F403
from model.hf.configs import ARCHITECTURES, CUSTOM_WEIGHTS, VARIANT_KEY, Imported, load_hf_config, model_config_from_hf  # noqa: F401
from model.hf.tensors import *  # noqa: F403
from model.hf.tensors import (  # noqa: F401
    DTYPE_NAMES,
    DTYPES,
    cast,
    check_hf_indexes,
    from_hf_state_dict,
    load_hf_weights,
    save_hf_weights,
    to_hf_state_dict,
)
