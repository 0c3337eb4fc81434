"""The decoder stack on the CPU as one flat run of C kernel calls: the CPU's counterpart of CUDA graphs.

``LlamaForCausalLM.forward`` goes layer by layer through the backend objects: each of a
layer's ten kernel calls passes through a Python wrapper (checks, strides, a new output
tensor) and the layer's torch views and ``nn.Module`` attributes. That costs ~20 ms per
step of a 30-layer model on a 2-core CPU, as much as the whole attention of a 32-token
prefill over 1,024 cached tokens, because the weights streamed between two calls evict
the interpreter's working set from the caches. A decode step pays the same.

``CpuGraph`` runs the same kernels, in the same order, on the same arguments, so its
hidden states equal the layer-by-layer path's bit for bit (tested), with what can be fixed
fixed once: the bound C functions and every weight's address at build time, one set of
activation buffers per step (reused by every layer), the KV caches' addresses per cache.
What is left per layer is ten ctypes calls. It serves every batch the layer-by-layer path
serves on the CPU backends: decodes and prefill chunks in one step, biases, and LoRA.

LoRA runs inside the graph: the applier plans the step once (``LoRABatch.c_sites``: every
group's token grouping and page passes, every site's weight addresses) and each site is one
more ctypes call of the grouped C kernel, which adds the deltas into the projection's output
buffer in place. Only an applier that cannot plan a step (no C kernel for its weights) is
called back per site, with the step's buffers as tensors; ``lora_steps`` counts which path
each step with adapters took.

It applies only when every part is a C kernel: float32 weights packed for the C linear
kernel or packed (quantized) weights in a format ``quant_linear.c`` decodes, the C
pointwise kernels, the C attention backend with its extend kernel in use and shapes both
attention kernels take. ``CpuGraph.build`` says why not otherwise, and the
model keeps its layer-by-layer path (also the path with ``enforce_eager``).
"""

from __future__ import annotations

from typing import Any

import torch

from loraplex.kernels.contracts import AttentionBackend, PackedWeight, Weight
from loraplex.kernels.cpu import linear as c_linear
from loraplex.kernels.cpu import lora as c_lora
from loraplex.kernels.cpu import paged_decode, paged_extend, pointwise, quant_linear
from loraplex.kernels.cpu.attention import CpuAttentionBackend, kv_write_kernel
from loraplex.kernels.metadata import PAD_BLOCK_ID
from loraplex.platform.model.forward_batch import ForwardBatch, LoRABatch, LoRASites
from loraplex.storage.kv.kv_cache import KVCache


class CpuGraph:
    """A model's forward as prebound C calls; ``CpuGraph.build`` makes one when every part allows."""

    def __init__(self, model: Any, kernels: dict[str, Any]) -> None:
        self._model = model
        self._k = kernels
        arch = model.arch
        self._h = arch.hidden_size
        self._q = arch.q_size
        self._kv = arch.kv_size
        self._qkv = arch.q_size + 2 * arch.kv_size
        self._inter = arch.intermediate_size
        self._heads = arch.num_heads
        self._kv_heads = arch.num_kv_heads
        self._head_dim = arch.head_dim
        self._eps = arch.rms_norm_eps

        def ptr(t: torch.Tensor | None) -> int | None:
            return None if t is None else t.data_ptr()

        float_linear, packed_linear = kernels["linear"], kernels["qlinear"]

        def proj(weight: Weight) -> tuple[Any, int, tuple[int, ...]]:
            """(C function, weight address, trailing arguments): the float panel kernel, or the
            packed one with the weight's format, row bytes and plan 0 (by rows of x)."""
            if isinstance(weight, PackedWeight):
                return packed_linear, weight.data.data_ptr(), (weight.format.c_id, weight.data.shape[1], 0)
            return float_linear, weight.data_ptr(), ()

        # Per layer: the addresses the kernels read (weights are never moved after loading).
        self._layers = [
            (
                ptr(layer.input_norm),
                proj(layer.qkv_weight),
                ptr(layer.qkv_bias),
                proj(layer.o_weight),
                ptr(layer.o_bias),
                ptr(layer.post_norm),
                proj(layer.gate_up_weight),
                ptr(layer.gate_up_bias),
                proj(layer.down_weight),
                ptr(layer.down_bias),
                layer.scale,
                layer.sliding_window or 0,  # a windowed layer's window (Mistral, Qwen2); 0: none
                ptr(layer.q_norm),  # per-head q and k norms (Qwen3), or None
                ptr(layer.k_norm),
            )
            for layer in model.layers
        ]
        self._final_norm = model.norm.data_ptr()
        self._caches: tuple[KVCache, list[tuple[int, int]]] | None = None
        self.lora_steps = {"c": 0, "hook": 0}
        """Steps with adapters, by how their LoRA ran: ``c`` prebound kernel calls inside the
        graph, ``hook`` the applier called back per site (its weights not on the C kernel)."""

    @classmethod
    def build(cls, model: Any, attn: AttentionBackend) -> tuple[CpuGraph | None, str]:
        """A graph for ``model`` served by ``attn``, or None and why it cannot be one."""
        if model.dtype != torch.float32 or model.norm.device.type != "cpu":
            return None, "the graph runs float32 models on the CPU"

        def on_c_kernel(weight: Weight) -> bool:
            if isinstance(weight, PackedWeight):  # packed: a format the C kernel decodes
                return weight.format.c_id > 0
            return weight.dim() == 3  # float: packed in panels by the C linear backend

        if not isinstance(model.linear, c_linear.CpuLinearBackend) or not all(
            on_c_kernel(getattr(layer, f"{name}_weight"))
            for layer in model.layers
            for name in ("qkv", "o", "gate_up", "down")
        ):
            return None, "the projections are not on the C linear kernels (linear_backend)"
        if not isinstance(model.pointwise, pointwise.CpuPointwiseBackend):
            return None, "the norms and activations are not on the C pointwise kernels"
        if not isinstance(attn, CpuAttentionBackend) or not attn.extend_in_c:
            return None, "attention is not on the C decode and extend kernels (attention_backend)"
        arch = model.arch
        # The graph runs Llama's layer (with biases, per-layer windows and per-head q/k norms:
        # Qwen2/3, Mistral, Phi-3 once fused); what Gemma adds runs on the layer-by-layer path.
        extras = [
            name
            for name, present in (
                ("Gemma norms", arch.gemma_norms),
                ("embedding scale", arch.embed_scale is not None),
                ("GeLU", arch.activation != "silu"),
                ("attention soft-capping", arch.attn_logit_softcap is not None),
                ("several RoPE tables", getattr(model, "num_ropes", 1) > 1),
            )
            if present
        ]
        if extras:
            return None, f"the graph runs Llama-shaped layers; {arch.family} has {', '.join(extras)}"
        query = torch.empty(1, arch.num_heads, arch.head_dim)
        cache = torch.empty(1, 16, arch.num_kv_heads, arch.head_dim)
        if not (paged_decode.supports(query, cache) and paged_extend.supports(query, cache)):
            return None, "the attention kernels do not take this model's heads"
        fns = pointwise.c_kernels()
        kernels = {
            "linear": c_linear.c_kernel(),
            "qlinear": quant_linear.c_kernel(),
            "kv_write": kv_write_kernel(),
            "decode": paged_decode.c_kernel(torch.float32),
            "extend": paged_extend.c_kernel(torch.float32),
            **(fns or {}),
        }
        if fns is None or any(f is None for f in kernels.values()):
            return None, "the C kernel library is not loaded"
        kernels["lora"] = c_lora.grouped_kernel()  # None: adapters go through the hook
        return cls(model, kernels), ""

    def _cache_pointers(self, kv_cache: KVCache) -> list[tuple[int, int]]:
        if self._caches is None or self._caches[0] is not kv_cache:
            for t in (*kv_cache.k, *kv_cache.v):
                if (
                    t.dtype != torch.float32
                    or not t.is_contiguous()
                    or t.shape[2:]
                    != (
                        self._kv_heads,
                        self._head_dim,
                    )
                ):
                    raise ValueError(
                        f"KV cache layer of {t.dtype} {tuple(t.shape)} does not fit the CPU graph"
                    )
            self._caches = (
                kv_cache,
                [(k.data_ptr(), v.data_ptr()) for k, v in zip(kv_cache.k, kv_cache.v, strict=True)],
            )
        return self._caches[1]

    def _lora_sites(self, lora: LoRABatch, widths: tuple[int, ...]) -> LoRASites | None:
        """The step's LoRA as prebound kernel calls, or None (the hook serves): planned once,
        checked against the graph's buffers (``widths``: in, out of qkv, o, gate_up, down)."""
        sites = None if self._k["lora"] is None else lora.c_sites(len(self._layers))
        if sites is not None and not all(
            site is None or (site.in_features == widths[2 * g] and site.out_features <= widths[2 * g + 1])
            for row in sites
            for g, site in enumerate(row)
        ):
            sites = None
        self.lora_steps["hook" if sites is None else "c"] += 1
        return sites

    def forward(self, batch: ForwardBatch, kv_cache: KVCache) -> torch.Tensor:  # [num_tokens, hidden]
        """Every layer over ``batch`` (what ``LlamaForCausalLM.forward`` returns, bit for bit)."""
        model, k = self._model, self._k
        h, q, kv, qkv_w, inter = self._h, self._q, self._kv, self._qkv, self._inter
        heads, kv_heads, head_dim, eps = self._heads, self._kv_heads, self._head_dim, self._eps
        meta = batch.attn
        n = batch.num_tokens
        nt = torch.get_num_threads()
        caches = self._cache_pointers(kv_cache)
        num_blocks, block_size = kv_cache.k[0].shape[0], kv_cache.k[0].shape[1]
        num_slots = num_blocks * block_size
        row_bytes = kv * 4

        residual = model.embed_tokens(batch.input_ids)  # the residual stream, updated in place
        cos = model.rope_cos[batch.positions]
        sin = model.rope_sin[batch.positions]
        x = torch.empty(n, h)
        qkv = torch.empty(n, qkv_w)
        attn_out = torch.empty(n, q)
        o = torch.empty(n, h)
        gate_up = torch.empty(n, 2 * inter)
        act = torch.empty(n, inter)
        down = torch.empty(n, h)
        x_p, res_p, qkv_p, ao_p, o_p, gu_p, act_p, down_p = (
            t.data_ptr() for t in (x, residual, qkv, attn_out, o, gate_up, act, down)
        )
        cos_p, sin_p, cs_stride = cos.data_ptr(), sin.data_ptr(), cos.stride(0)

        nd = meta.num_decodes
        ns = meta.num_seqs
        tables = meta.block_tables
        if not (
            tables.dtype == torch.int32
            and tables.stride(1) == 1
            and meta.seq_lens.dtype == torch.int32
            and meta.seq_lens.is_contiguous()
            and meta.query_start_loc.dtype == torch.int32
            and meta.query_start_loc.is_contiguous()
            and meta.slot_mapping.dtype == torch.int64
            and meta.slot_mapping.is_contiguous()
        ):
            raise ValueError("attention metadata: int32 block-table rows, seq_lens and starts; int64 slots")
        table_stride = tables.stride(0)
        slots = meta.slot_mapping.data_ptr()
        seq_lens = meta.seq_lens.data_ptr()
        starts = meta.query_start_loc.data_ptr()
        tables_p = tables.data_ptr()
        int_bytes = 4
        # What the decode and extend kernels take after their per-call arguments, before scale.
        attn_shape = (heads, kv_heads, head_dim, block_size, table_stride, num_blocks)
        lora = batch.lora
        sites = None if lora is None else self._lora_sites(lora, (h, qkv_w, q, h, h, 2 * inter, inter, h))
        if sites is not None:
            lora = None  # served by the prebound calls below
        lora_k = k["lora"]

        norm, rope, kv_write = k["add_rms_norm"], k["rope_neox"], k["kv_write"]
        decode, extend, silu = k["decode"], k["extend"], k["silu_mul"]
        rot_heads = heads + kv_heads
        head_norm = k["head_rms_norm"]
        for i, (
            w_in,
            p_qkv,
            b_qkv,
            p_o,
            b_o,
            w_post,
            p_gu,
            b_gu,
            p_down,
            b_down,
            scale,
            window,
            w_qn,
            w_kn,
        ) in enumerate(self._layers):
            (f_qkv, w_qkv, t_qkv), (f_o, w_o, t_o) = p_qkv, p_o
            (f_gu, w_gu, t_gu), (f_down, w_down, t_down) = p_gu, p_down
            kc, vc = caches[i]
            if i == 0:
                norm(None, 0, res_p, h, w_in, x_p, h, n, h, eps, nt)
            else:
                norm(down_p, h, res_p, h, w_in, x_p, h, n, h, eps, nt)
            if f_qkv(x_p, h, w_qkv, b_qkv, qkv_p, qkv_w, n, qkv_w, h, nt, *t_qkv):
                raise RuntimeError("quantized linear failed")
            if sites is not None and (site := sites[i][0]) is not None:
                _lora_ok(lora_k(x_p, h, qkv_p, qkv_w, *site.args, nt))
            elif lora is not None:
                lora(i, "qkv", x, qkv)
            if w_qn is not None:  # per-head RMSNorm of q, then of k (the layer path's two calls)
                head_norm(qkv_p, qkv_w, heads, head_dim, w_qn, n, eps, nt)
                head_norm(qkv_p + 4 * q, qkv_w, kv_heads, head_dim, w_kn, n, eps, nt)
            rope(qkv_p, qkv_w, rot_heads, head_dim, cos_p, sin_p, cs_stride, n, nt)
            if kv_write(
                qkv_p + 4 * q,
                4 * qkv_w,
                qkv_p + 4 * (q + kv),
                4 * qkv_w,
                kc,
                vc,
                slots,
                n,
                row_bytes,
                num_slots,
            ):
                raise IndexError(f"KV slots outside the cache's {num_slots} slots")
            bad = 0
            if nd:
                bad += decode(
                    qkv_p, kc, vc, tables_p, seq_lens, ao_p, qkv_w, nd, *attn_shape, scale, window, 0.0, nt
                )
            if ns > nd:
                bad += extend(
                    qkv_p,
                    kc,
                    vc,
                    tables_p + nd * table_stride * int_bytes,
                    seq_lens + nd * int_bytes,
                    starts + nd * int_bytes,
                    ao_p,
                    qkv_w,
                    n,
                    ns - nd,
                    *attn_shape,
                    scale,
                    window,
                    0.0,  # no logit soft-capping (models that have it take the layer-by-layer path)
                    0,  # max row vectors: the kernel's choice
                    nt,
                )
            if bad:
                raise ValueError(
                    f"attention: {bad} sequences or work items had bad query rows or lengths, or a block id "
                    f"outside [0, {num_blocks}) such as PAD_BLOCK_ID ({PAD_BLOCK_ID})"
                )
            if f_o(ao_p, q, w_o, b_o, o_p, h, n, h, q, nt, *t_o):
                raise RuntimeError("quantized linear failed")
            if sites is not None and (site := sites[i][1]) is not None:
                _lora_ok(lora_k(ao_p, q, o_p, h, *site.args, nt))
            elif lora is not None:
                lora(i, "o", attn_out, o)
            norm(o_p, h, res_p, h, w_post, x_p, h, n, h, eps, nt)
            if f_gu(x_p, h, w_gu, b_gu, gu_p, 2 * inter, n, 2 * inter, h, nt, *t_gu):
                raise RuntimeError("quantized linear failed")
            if sites is not None and (site := sites[i][2]) is not None:
                _lora_ok(lora_k(x_p, h, gu_p, 2 * inter, *site.args, nt))
            elif lora is not None:
                lora(i, "gate_up", x, gate_up)
            silu(gu_p, 2 * inter, act_p, inter, n, inter, nt)
            if f_down(act_p, inter, w_down, b_down, down_p, h, n, h, inter, nt, *t_down):
                raise RuntimeError("quantized linear failed")
            if sites is not None and (site := sites[i][3]) is not None:
                _lora_ok(lora_k(act_p, inter, down_p, h, *site.args, nt))
            elif lora is not None:
                lora(i, "down", act, down)
        out = torch.empty(n, h)
        norm(down_p, h, res_p, h, self._final_norm, out.data_ptr(), h, n, h, eps, nt)
        return out


def _lora_ok(bad: int) -> None:
    """Raise for the grouped LoRA kernel's error returns (0: every group served)."""
    if bad < 0:
        raise MemoryError("LoRA: the C kernel could not allocate its scratch memory")
    if bad:
        raise ValueError(f"LoRA: {bad} token groups point at a slot outside the adapter pool")
