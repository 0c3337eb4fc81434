"""Our decoder forward over a flat batch that reads and writes a paged KV cache: Llama's,
with the parts other families add (``arch.py``, ``families.py``) switched on by the arch.

Projections are fused (q|k|v into one matrix, gate|up into one) so each layer runs
four matmuls; the LoRA hook adds every adapter's delta to those fused outputs in
the same pass, each token with its own adapter slot. The arithmetic mirrors HF
transformers (RMSNorm in float32, RoPE tables in float32 cast to the model dtype)
so greedy tokens match token for token in float32.

The residual stream travels next to the hidden state (vLLM's layout): each layer
returns its MLP output and the residual, and the next norm adds the two in the same
call (``PointwiseBackend.add_rms_norm``), so a layer's elementwise work is four calls.

Family parts: q/k RMSNorm per head before RoPE (Qwen3, Gemma 3); Gemma's norms after
attention and after the MLP (their (1 + w) scale is folded into the weights at load
time, so every norm here is ``w * x / rms(x)``); a sliding window and logit soft-capping
per layer (passed to the attention backend); GeLU-tanh; the embedding scale; a RoPE
table per layer type (Gemma 3's local and global bases); final logit soft-capping.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from loraplex.kernels.contracts import AttentionBackend, LinearBackend, PackedWeight, PointwiseBackend, Weight
from loraplex.kernels.metadata import AttentionMetadata
from loraplex.kernels.portable.linear import PortableLinearBackend
from loraplex.kernels.portable.pointwise import PortablePointwiseBackend
from loraplex.platform.model.arch import ModelArch, RopeSpec, rope_tables
from loraplex.platform.model.cpu_graph import CpuGraph
from loraplex.platform.model.forward_batch import ForwardBatch, LoRABatch
from loraplex.storage.kv.kv_cache import KVCache

LORA_GROUPS = ("qkv", "o", "gate_up", "down")
PROJECTIONS = LORA_GROUPS  # each layer's fused projections: <name>_weight, <name>_bias


class DecoderLayer(nn.Module):
    """One pre-norm decoder block: attention then SwiGLU MLP, each with a residual."""

    def __init__(self, arch: ModelArch, layer_idx: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.arch = arch
        h, q, kv, i = arch.hidden_size, arch.q_size, arch.kv_size, arch.intermediate_size

        def param(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)

        self.input_norm = param(h)
        self.qkv_weight = param(q + 2 * kv, h)  # rows: q | k | v
        self.qkv_bias = param(q + 2 * kv) if arch.qkv_bias else None
        self.o_weight = param(h, q)
        self.o_bias = param(h) if arch.o_bias else None
        self.post_norm = param(h)  # the norm before the MLP (Gemma: pre_feedforward_layernorm)
        # Gemma: post_attention_layernorm (on the attention output) and post_feedforward_layernorm
        self.attn_out_norm = param(h) if arch.gemma_norms else None
        self.mlp_out_norm = param(h) if arch.gemma_norms else None
        self.q_norm = param(arch.head_dim) if arch.qk_norm else None  # per head, before RoPE
        self.k_norm = param(arch.head_dim) if arch.qk_norm else None
        self.gate_up_weight = param(2 * i, h)  # rows: gate | up
        self.gate_up_bias = param(2 * i) if arch.mlp_bias else None
        self.down_weight = param(h, i)
        self.down_bias = param(h) if arch.mlp_bias else None
        self.scale = arch.attn_scale or arch.head_dim**-0.5
        self.sliding_window = arch.window_of(layer_idx)  # this layer's attention window (None: global)
        self.logit_softcap = arch.attn_logit_softcap  # attention logit soft-capping (None: none)
        self.rope = arch.rope_of(layer_idx)  # which of the model's RoPE tables this layer uses
        self.out_features = {"qkv": q + 2 * kv, "o": h, "gate_up": 2 * i, "down": h}
        self.linear: LinearBackend = PortableLinearBackend()
        self.pointwise: PointwiseBackend = PortablePointwiseBackend()

    def use_linear(self, linear: LinearBackend, int8_activations: bool = False) -> None:
        """Compute the projections with ``linear``, its own weight layout replacing ours
        (packed weights: the same blocks in the layout it reads best)."""
        for name in PROJECTIONS:
            weight = getattr(self, f"{name}_weight")
            if isinstance(weight, PackedWeight):
                setattr(self, f"{name}_weight", linear.prepare_packed(weight, int8_activations))
                continue
            setattr(self, f"{name}_weight", nn.Parameter(linear.prepare(weight.data), requires_grad=False))
        self.linear = linear

    def set_packed(self, name: str, weight: PackedWeight) -> None:
        """Keep projection ``name`` (``qkv_weight``, ...) packed instead of as a float parameter."""
        delattr(self, name)  # the float parameter goes (it was never filled)
        setattr(self, name, weight)

    def _project(self, name: str, x: torch.Tensor) -> torch.Tensor:
        weight, bias = getattr(self, f"{name}_weight"), getattr(self, f"{name}_bias")
        return self.linear(x, weight, bias, self.out_features[name])

    def forward(
        self,
        hidden: torch.Tensor,  # [T, hidden]: the previous layer's MLP output (the embedding for layer 0)
        residual: torch.Tensor | None,  # [T, hidden]: the residual stream before ``hidden`` (None at layer 0)
        cos: torch.Tensor,  # [T, head_dim]
        sin: torch.Tensor,  # [T, head_dim]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        attn: AttentionBackend,
        lora: LoRABatch | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (this layer's MLP output, the residual stream before it)
        arch = self.arch
        pw = self.pointwise
        num_tokens = hidden.shape[0]
        if residual is None:
            x, residual = pw.add_rms_norm(None, hidden, self.input_norm, arch.rms_norm_eps)
        else:
            x, residual = pw.add_rms_norm(hidden, residual, self.input_norm, arch.rms_norm_eps)
        qkv = self._project("qkv", x)
        if lora is not None:
            lora(self.layer_idx, "qkv", x, qkv)
        if self.q_norm is not None and self.k_norm is not None:
            self._qk_norm(qkv)
        # q and k heads are adjacent in each fused row: one rotary call turns both in place.
        pw.rotary(qkv[:, : arch.q_size + arch.kv_size], cos, sin, arch.head_dim)
        q, k, v = qkv.split([arch.q_size, arch.kv_size, arch.kv_size], dim=-1)
        q = q.view(num_tokens, arch.num_heads, arch.head_dim)
        k = k.view(num_tokens, arch.num_kv_heads, arch.head_dim)
        v = v.view(num_tokens, arch.num_kv_heads, arch.head_dim)
        attn.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = attn.forward(
            q,
            k_cache,
            v_cache,
            meta,
            self.scale,
            sliding_window=self.sliding_window,
            logit_softcap=self.logit_softcap,
        ).reshape(num_tokens, arch.q_size)
        o = self._project("o", out)
        if lora is not None:
            lora(self.layer_idx, "o", out, o)
        if self.attn_out_norm is not None:
            o, _ = pw.add_rms_norm(None, o, self.attn_out_norm, arch.rms_norm_eps)

        x, residual = pw.add_rms_norm(o, residual, self.post_norm, arch.rms_norm_eps)
        gate_up = self._project("gate_up", x)
        if lora is not None:
            lora(self.layer_idx, "gate_up", x, gate_up)
        if arch.activation == "gelu_tanh":
            gate, up = gate_up.chunk(2, dim=-1)
            act = F.gelu(gate, approximate="tanh") * up
        else:
            act = pw.silu_and_mul(gate_up)
        down = self._project("down", act)
        if lora is not None:
            lora(self.layer_idx, "down", act, down)
        if self.mlp_out_norm is not None:
            down, _ = pw.add_rms_norm(None, down, self.mlp_out_norm, arch.rms_norm_eps)
        return down, residual

    def _qk_norm(self, qkv: torch.Tensor) -> None:
        """RMSNorm of every q and k head (its own weight for q and for k), in place in ``qkv``
        (the CPU graph makes the same two kernel calls)."""
        q, kv, eps = self.arch.q_size, self.arch.kv_size, self.arch.rms_norm_eps
        assert self.q_norm is not None and self.k_norm is not None
        self.pointwise.head_rms_norm(qkv[:, :q], self.q_norm, eps)
        self.pointwise.head_rms_norm(qkv[:, q : q + kv], self.k_norm, eps)


class LlamaForCausalLM(nn.Module):
    """Token ids in, last-position logits out; K/V go through the paged cache."""

    def __init__(self, arch: ModelArch, dtype: torch.dtype, max_positions: int) -> None:
        super().__init__()
        self.arch = arch
        self.dtype = dtype
        self.embed: nn.Parameter | PackedWeight = nn.Parameter(
            torch.empty(arch.vocab_size, arch.hidden_size, dtype=dtype), requires_grad=False
        )
        self.layers = nn.ModuleList([DecoderLayer(arch, i, dtype) for i in range(arch.num_layers)])
        self.norm = nn.Parameter(torch.empty(arch.hidden_size, dtype=dtype), requires_grad=False)
        self.lm_head: nn.Parameter | PackedWeight | None = (
            None
            if arch.tie_word_embeddings
            else nn.Parameter(
                torch.empty(arch.vocab_size, arch.hidden_size, dtype=dtype), requires_grad=False
            )
        )
        # One cos/sin table per RoPE spec (Gemma 3: local and global bases); rope_cos/rope_sin
        # are the first (the only one of most models, which the CPU graph reads).
        specs = arch.ropes or (RopeSpec(arch.rope_theta, arch.rope_scaling),)
        tables = [rope_tables(spec, arch.head_dim, max_positions) for spec in specs]
        self.rope_cos: torch.Tensor
        self.rope_sin: torch.Tensor
        self.register_buffer("rope_cos", tables[0][0], persistent=False)
        self.register_buffer("rope_sin", tables[0][1], persistent=False)
        for j, (cos, sin) in enumerate(tables[1:], start=1):
            self.register_buffer(f"rope_cos_{j}", cos, persistent=False)
            self.register_buffer(f"rope_sin_{j}", sin, persistent=False)
        self.num_ropes = len(tables)
        self.linear: LinearBackend = PortableLinearBackend()
        self.pointwise: PointwiseBackend = PortablePointwiseBackend()
        self._logits_weight: Weight | None = None  # the LM head in the linear backend's layout
        self._graph: CpuGraph | None = None  # the layers as prebound C calls (use_cpu_graph)
        self._graph_attn: AttentionBackend | None = None

    def use_pointwise(self, pointwise: PointwiseBackend) -> None:
        """Run the norms, rotary embedding and activation with ``pointwise``."""
        self.pointwise = pointwise
        for layer in self.layers:
            assert isinstance(layer, DecoderLayer)
            layer.pointwise = pointwise

    def set_packed(self, key: str, weight: PackedWeight) -> None:
        """Keep weight ``key`` packed: ``layers.{i}.{projection}_weight``, ``embed`` (looked up by
        decoding rows; also the LM head when tied), ``lm_head``, or ``logits`` (the LM head of a
        tied model whose lookup keeps the float table). Call before ``use_linear``."""
        if key == "logits":
            self._logits_weight = weight
        elif key in ("embed", "lm_head"):
            delattr(self, key)
            setattr(self, key, weight)
        else:
            _, index, name = key.split(".")
            layer = self.layers[int(index)]
            assert isinstance(layer, DecoderLayer)
            layer.set_packed(name, weight)

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden]
        """The embedding rows of ``input_ids`` (decoded from blocks when the table is packed)."""
        if isinstance(self.embed, PackedWeight):
            rows = self.linear.rows(self.embed, input_ids).to(self.dtype)
        else:
            rows = F.embedding(input_ids, self.embed)
        if self.arch.embed_scale is not None:
            # Gemma: the scale rounded to the model's dtype first, as HF does.
            rows = rows * torch.tensor(self.arch.embed_scale, dtype=self.dtype)
        return rows

    def use_linear(self, linear: LinearBackend, int8_activations: bool = False) -> None:
        """Compute every projection and the LM head with ``linear`` (call once, after loading);
        ``int8_activations``: llama.cpp's int8 activations where a packed layout has them."""
        for layer in self.layers:
            assert isinstance(layer, DecoderLayer)
            layer.use_linear(linear, int8_activations)
        if isinstance(self.embed, PackedWeight):  # its lookup reads through the layout (rows)
            self.embed = linear.prepare_packed(self.embed, int8_activations)
        if isinstance(self.lm_head, PackedWeight):
            self.lm_head = linear.prepare_packed(self.lm_head, int8_activations)
        if isinstance(self._logits_weight, PackedWeight):
            self._logits_weight = linear.prepare_packed(self._logits_weight, int8_activations)
        if isinstance(self.lm_head, nn.Parameter):
            self.lm_head = nn.Parameter(linear.prepare(self.lm_head.data), requires_grad=False)
            self._logits_weight = None
        elif self.lm_head is not None or isinstance(self._logits_weight, PackedWeight):
            pass  # packed: read as it is
        elif isinstance(self.embed, PackedWeight):
            self._logits_weight = None  # tied to a packed table: the LM head reads it
        else:
            # Tied: the embedding lookup needs the plain matrix, so a re-laid-out LM head
            # is a second copy (none for the torch backend, whose prepare returns it).
            prepared = linear.prepare(self.embed.data)
            self._logits_weight = None if prepared is self.embed.data else prepared
        self.linear = linear

    def use_cpu_graph(self, attn: AttentionBackend) -> str:
        """Run the layers as one flat run of C calls (``CpuGraph``) when served by ``attn``.

        Call after ``use_linear`` / ``use_pointwise``. Returns "" when the graph is in use,
        else why not (the layer-by-layer path serves then, with the same results).
        """
        self._graph, why = CpuGraph.build(self, attn)
        self._graph_attn = attn if self._graph is not None else None
        return why

    @property
    def cpu_graph(self) -> CpuGraph | None:
        """The graph serving the layers (``use_cpu_graph``), or None; its ``lora_steps`` counts
        how each step with adapters ran (``c``: inside the graph, ``hook``: called back)."""
        return self._graph

    def forward(
        self, batch: ForwardBatch, kv_cache: KVCache, attn: AttentionBackend
    ) -> torch.Tensor:  # [num_tokens, hidden]
        """Run every layer over ``batch``, reading and writing ``kv_cache`` through ``attn``."""
        if self._graph is not None and attn is self._graph_attn:
            return self._graph.forward(batch, kv_cache)
        hidden = self.embed_tokens(batch.input_ids)
        cos_sin = [self._rope_rows(j, batch.positions) for j in range(self.num_ropes)]
        residual: torch.Tensor | None = None
        for i, layer in enumerate(self.layers):
            assert isinstance(layer, DecoderLayer)
            cos, sin = cos_sin[layer.rope]
            hidden, residual = layer(
                hidden, residual, cos, sin, kv_cache.k[i], kv_cache.v[i], batch.attn, attn, batch.lora
            )
        assert residual is not None, "a model has at least one layer"
        normed, _ = self.pointwise.add_rms_norm(hidden, residual, self.norm, self.arch.rms_norm_eps)
        return normed

    def _rope_rows(self, j: int, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        suffix = f"_{j}" if j else ""
        cos = getattr(self, "rope_cos" + suffix)[positions].to(self.dtype)
        sin = getattr(self, "rope_sin" + suffix)[positions].to(self.dtype)
        return cos, sin

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, vocab] float32
        weight = self._logits_weight
        if weight is None:
            weight = self.embed if self.lm_head is None else self.lm_head
        logits = self.linear(hidden, weight, None, self.arch.vocab_size)
        cap = self.arch.final_logit_softcap
        if cap:  # Gemma 2: in the model's dtype, as HF does
            logits = torch.tanh(logits / cap) * cap
        return logits.float()
