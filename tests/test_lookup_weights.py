"""Loss weights away from what the lookup proposes: the reply tokens a match of the context continues,
written as train.loss.token_weights entries the trainer reads."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from eagle3.train.token_weights import read_token_weights
from hard_mining.lookup_weights import lookup_tokens, lookup_weights, main


def test_reply_tokens_continuing_an_earlier_match_are_listed() -> None:
    #      0  1  2  3  4  5  6  7  8  9
    ids = [5, 6, 7, 8, 9, 5, 6, 7, 3, 6]
    mask = [False] * 5 + [True] * 5  # the reply: tokens 5..9
    # 5: no match before ("9" never seen followed by anything); 6 after "5" (1-token match: too short);
    # 7 after "5 6" (2 tokens, 7 followed them): listed; 3 after "5 6 7" (8 followed): not the lookup's;
    # 6 after "3": no match
    assert lookup_tokens(ids, mask, min_match=2) == [7]
    assert lookup_tokens(ids, mask, min_match=1) == [6, 7]
    assert lookup_tokens(ids, [False] * 10, min_match=1) == []  # prompt tokens are never listed


class _Store:
    sample_ids = ["a", "b"]

    def token_columns(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = [[1, 2, 3, 1, 2, 3, 1, 2], [4, 5, 6, 7]][i]
        return torch.tensor(ids), torch.tensor([j >= 3 for j in range(len(ids))])


def test_the_weights_file_is_what_the_trainer_reads(tmp_path: Path, monkeypatch, capsys) -> None:
    weights, counts = lookup_weights(_Store(), 0.25, min_match=2)
    assert weights == {"a": [[5, 0.25], [6, 0.25], [7, 0.25]]}  # "1 2 3" repeats: 3 at j=5, then 1, 2
    assert counts == {"samples": 2, "reply_tokens": 6, "weighted_tokens": 3}
    assert read_token_weights(_write(tmp_path, weights), ["a", "b"]) == {"a": [(5, 0.25), (6, 0.25), (7, 0.25)]}
    import eagle3.store.shards as shards

    monkeypatch.setattr(shards, "open_stores", lambda roots: _Store())
    out = tmp_path / "w.json"
    assert main(["--store", "x", "--out", str(out), "--weight", "0.5"]) == 0
    assert json.loads(out.read_text())["a"][0] == [5, 0.5]
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["weighted_share"] == 0.5
    assert main(["--store", "x", "--out", str(out), "--weight", "2"]) == 2
    assert "--weight 2.0: expected 0..1" in capsys.readouterr().err


def _write(tmp_path: Path, weights: dict) -> str:
    path = tmp_path / "weights.json"
    path.write_text(json.dumps(weights))
    return str(path)
