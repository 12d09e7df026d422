"""Methods the ``vllm`` backend adds to vLLM's workers (its ``worker_extension_cls``).

vLLM mixes this class into each of its worker processes, so that ``collective_rpc`` can
call its methods by name (a function would have to be pickled, which vLLM allows only
with ``VLLM_ALLOW_INSECURE_SERIALIZATION``). This module runs inside vLLM's engine core:
it imports vLLM freely and nothing of the proxy.
"""

from __future__ import annotations

from typing import Any

# How the backend names it to vLLM.
EXTENSION = f"{__name__}.RelayWorkerExtension"


class RelayWorkerExtension:
    """Mixed into vLLM's ``Worker``: ``self`` has its ``model_runner``."""

    model_runner: Any

    def repack_embedding_gemms(self) -> int:
        """Pack the weights of every embedding-shaped layer for vLLM's CPU matrix multiply
        again, from the weights they hold now; return how many were packed.

        Why: on CPU, vLLM packs the output head's weight into a kernel layout once, at
        load, and multiplies with that copy. An in-place ``reload_weights`` loads the
        embeddings, which a tied output head shares, but loads nothing for the head
        itself (vLLM 0.32 logs ``ParallelLMHead: Failed to load weights``) and so never
        packs it again: the engine would go on sampling through the OLD head. Running
        the layer's own post-load step again is what loading does; on a GPU it packs
        nothing, and this returns 0.
        """
        from vllm.model_executor.layers.vocab_parallel_embedding import (
            UnquantizedEmbeddingMethod,
        )
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return 0
        packed = 0
        for module in self.model_runner.get_model().modules():
            method = getattr(module, "quant_method", None)
            weight = getattr(module, "weight", None)
            if isinstance(method, UnquantizedEmbeddingMethod) and weight is not None:
                method.process_weights_after_loading(module)
                packed += 1
        return packed
