"""The server routes ``model=<adapter name>`` to that adapter (vLLM's --lora-modules)."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from loraplex import LLM, LoRARequest, SamplingParams
from loraplex.cli.serve import register_lora_modules
from loraplex.platform.api.app import build_app
from loraplex.platform.engine.async_engine import AsyncEngine
from loraplex.platform.engine.config import EngineConfig
from loraplex.platform.engine.engine import LLMEngine
from loraplex.platform.settings import ServerSettings


def test_adapter_selected_by_model_name(tiny_dirs: dict[str, Path], tmp_path: Path) -> None:
    from support.adapters import make_peft_adapter

    base = tiny_dirs["gqa_tied"]
    make_peft_adapter(
        base, tmp_path / "fr", seed=9, spec=dict(r=8, target_modules=["q_proj", "v_proj", "down_proj"])
    )
    cfg = EngineConfig(model=str(base), dtype="float32", num_kv_blocks=64, enable_lora=True, max_lora_rank=8)
    engine = LLMEngine(cfg)
    settings = ServerSettings(
        served_model_name="tiny", single_tenant=True, lora_modules=[f"french={tmp_path / 'fr'}"]
    )
    loras = register_lora_modules(engine, settings)
    with pytest.raises(ValueError, match="NAME=PATH"):
        register_lora_modules(
            engine,
            settings.model_copy(
                update={"serving": settings.serving.model_copy(update={"lora_modules": ["broken"]})}
            ),
        )
    aeng = AsyncEngine(engine)
    try:
        with TestClient(build_app(aeng, settings, loras)) as c:
            ids = [m["id"] for m in c.get("/v1/models").json()["data"]]
            assert ids == ["tiny", "french"]
            body = {"prompt": [5, 6, 7], "max_tokens": 6, "temperature": 0, "ignore_eos": True}
            base_text = c.post("/v1/completions", json={**body, "model": "tiny"}).json()["choices"][0]["text"]
            fr = c.post("/v1/completions", json={**body, "model": "french"}).json()
            assert fr["model"] == "french"
            assert c.post("/v1/completions", json={**body, "model": "german"}).status_code == 404
    finally:
        aeng.shutdown()
    offline = LLM(model=str(base), dtype="float32", num_kv_blocks=64, enable_lora=True, max_lora_rank=8)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    lora = LoRARequest("french", 1, str(tmp_path / "fr"))
    want = offline.generate([[5, 6, 7]], params, lora_request=lora, use_tqdm=False)[0].outputs[0].text
    assert fr["choices"][0]["text"] == want
    assert want != base_text
