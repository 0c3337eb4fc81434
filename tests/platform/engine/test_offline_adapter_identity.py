"""The offline API never serves stale weights for a ``LoRARequest``: the same name and id with other
files is a clear error naming both paths; the same content at another path is served."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from loraplex import LLM, LoRARequest, SamplingParams
from loraplex.platform.engine.errors import AdapterUnavailableError


@pytest.mark.slow
def test_same_id_other_content_is_refused_same_content_is_served(
    tiny_dirs: dict[str, Path], tmp_path: Path
) -> None:
    from support.adapters import make_peft_adapter

    base = tiny_dirs["gqa_tied"]
    spec = dict(r=4, target_modules=["q_proj", "v_proj"])
    make_peft_adapter(base, tmp_path / "old", seed=11, spec=spec)
    make_peft_adapter(base, tmp_path / "new", seed=12, spec=spec)
    shutil.copytree(tmp_path / "old", tmp_path / "old-copy")
    llm = LLM(model=str(base), dtype="float32", num_kv_blocks=64, enable_lora=True, max_lora_rank=8)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompt = [5, 6, 7, 8]

    def tokens(lora: LoRARequest) -> list[int]:
        return list(llm.generate(prompt, params, lora_request=lora, use_tqdm=False)[0].outputs[0].token_ids)

    old = tokens(LoRARequest("a", 1, str(tmp_path / "old")))
    with pytest.raises(AdapterUnavailableError) as refused:
        tokens(LoRARequest("a", 1, str(tmp_path / "new")))
    message = str(refused.value)
    assert (
        str(tmp_path / "new") in message and str(tmp_path / "old") in message and "remove_lora(1)" in message
    )
    assert not llm.llm_engine.has_unfinished_requests()
    # The same weights at another path are the same adapter: served, same tokens.
    assert tokens(LoRARequest("a", 1, str(tmp_path / "old-copy"))) == old
    # After remove_lora the id serves the new files (other weights: other tokens).
    llm.remove_lora(1)
    new = tokens(LoRARequest("a", 1, str(tmp_path / "new")))
    assert new != old
    assert tokens(LoRARequest("b", 2, str(tmp_path / "new"))) == new
