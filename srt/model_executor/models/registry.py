"""Model classes by the `architectures` field of a Hugging Face config."""

from __future__ import annotations

from srt.model_executor.models.gemma import GemmaForCausalLM
from srt.model_executor.models.llama import LlamaForCausalLM
from srt.model_executor.models.phi3 import Phi3ForCausalLM
from srt.model_executor.unsupported import UnsupportedModelError

MODEL_REGISTRY: dict[str, type] = {
    **{arch: LlamaForCausalLM for arch in LlamaForCausalLM.ARCH_SWITCHES},
    **{arch: GemmaForCausalLM for arch in GemmaForCausalLM.ARCH_SWITCHES},
    **{arch: Phi3ForCausalLM for arch in Phi3ForCausalLM.ARCH_SWITCHES},
}
# GGUF-converted configs may lack `architectures`; they are Llama-family (see gguf_convert).
DEFAULT_ARCHITECTURE = "LlamaForCausalLM"


def get_model_class(architectures: list[str] | None) -> tuple[str, type]:
    """The first supported architecture named by the config, with its class."""
    for arch in architectures or [DEFAULT_ARCHITECTURE]:
        if arch in MODEL_REGISTRY:
            return arch, MODEL_REGISTRY[arch]
    raise UnsupportedModelError(
        f"unsupported architectures {architectures}; supported: {', '.join(MODEL_REGISTRY)}"
    )
