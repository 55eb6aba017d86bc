"""The Responses agent benchmark's summary and table, from a synthetic result (model-free)."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import responses_agent, table_blocks
from benchmarks.report import Results


def _run(ttfts: list[float], sent: int) -> dict[str, object]:
    return {"round": 0, "load_average": [0.1, 0.2],
            "steps": [{"ttft": t, "total": t + 0.1, "sent_bytes": sent * (i + 1), "prompt_tokens": 100 * (i + 1),
                       "cached_tokens": 100 * i} for i, t in enumerate(ttfts)]}


def test_the_summary_and_table_of_a_run(tmp_path: Path) -> None:
    runs = {"responses-chained": [_run([1.0, 0.2, 0.3], 500), _run([1.2, 0.4, 0.1], 500)],
            "chat-history": [_run([1.0, 0.5, 0.6], 900)]}
    summary = responses_agent._summary(runs)  # noqa: SLF001
    chained = summary["responses-chained"]
    assert chained["rounds"] == 2 and chained["ttft_first"] == 1.1
    assert abs(chained["steps"][1]["ttft"] - 0.3) < 1e-9
    assert chained["sent_bytes_total"] == 500 + 1000 + 1500
    assert abs(summary["chat-history"]["ttft_later_mean"] - 0.55) < 1e-9
    result = {"summary": summary, "steps": 3, "max_tokens": 16, "rounds": 2, "system_words": 300,
              "observation_words": 60, "model": "m.gguf",
              "servers_settings": {"n_ctx": 4096, "parallel": 1, "threads": 2, "n_batch": 512, "flash_attn": True},
              "sides": {side: responses_agent.LABELS[side] for side in runs}, "machine": {"cpu": "test CPU"}}
    (tmp_path / "responses_agent.json").write_text(json.dumps(result))
    block = table_blocks.responses_agent(Results(tmp_path))
    assert "| `responses-chained` | `chat-history` |" in block
    assert "| 2 | 300 ms, 1,000 B, 100 of 200 cached |" in block
    assert "bytes sent in all | 3,000 B | 5,400 B |" in block
    assert "test CPU" in block
    assert "mean TTFT after step 1" in responses_agent._table(result)  # noqa: SLF001 - the script's own table
