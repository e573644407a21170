"""`pagoda bench lora` on the tiny Llama: its adapters are real PEFT directories (peft loads them and they
change the output), and a short run reports every configuration and both first-token times."""

import json

import pytest

from pagoda.bench import lora as bench

pytestmark = pytest.mark.model


def test_bench_adapters_are_peft_directories(tiny_llama_dir, tmp_path):
    import torch
    from checkpoints import load_hf_reference
    from peft import PeftModel

    from pagoda.config.model_files import load_hf_config
    from pagoda.lora.adapter import check_adapter

    hf_config = load_hf_config(str(tiny_llama_dir))
    path = bench.write_adapter(tmp_path / "a", hf_config, rank=4, seed=0)
    info = check_adapter(str(path), hf_config, max_lora_rank=4)
    assert info.max_rank == 4 and len(info.modules) == 7 * hf_config.num_hidden_layers
    ids = torch.tensor([[5, 17, 42, 9, 23]])
    with torch.no_grad():
        base = load_hf_reference(tiny_llama_dir)(ids).logits
        peft = PeftModel.from_pretrained(load_hf_reference(tiny_llama_dir), str(path))
        adapted = peft(input_ids=ids).logits
    assert len([n for n, _ in peft.named_parameters() if "lora_A" in n]) == 7 * hf_config.num_hidden_layers
    assert torch.isfinite(adapted).all() and not torch.allclose(base, adapted, atol=1e-4)


def test_bench_lora_reports_each_configuration(tiny_llama_dir, tmp_path):
    out = tmp_path / "lora.json"
    # prompts of 20 tokens: a full KV block each, which a prefix cache would hand the measured run after its
    # warm-up (the LoRA runs once looked faster than the base for it); the bench runs without one
    assert bench.main(["--model", str(tiny_llama_dir), "--adapters", "1", "2", "--num-requests", "4",
                       "--prompt-len", "20", "--max-tokens", "4", "--rank", "4", "--dtype", "float32",
                       "--repeats", "2", "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    assert [r.get("adapters") for r in results] == [0, 1, 2, None]
    for run in results[:3]:
        assert run["output_tokens"] == 16 and run["output_tokens_per_s"] > 0 and run["median_tpot_ms"] > 0
        assert run["prefix_cache_hits"] == 0
        assert len(run["runs_tokens_per_s"]) == 2 and run["output_tokens_per_s"] == min(run["runs_tokens_per_s"])
    assert results[0]["lora_enabled"] is False and results[1]["throughput_ratio_to_base"] > 0
    assert results[3]["ttft_new_adapter_ms"] > 0 and results[3]["ttft_loaded_adapter_ms"] > 0


def test_bench_lora_refuses_no_repeats(capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--repeats", "0"])
    assert "--repeats must be at least 1" in capsys.readouterr().err
