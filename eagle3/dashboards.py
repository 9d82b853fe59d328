"""The wandb dashboards, defined in code: which metric goes on which axis, panel by panel.

Every run this project logs (training, mining, serving evaluation) calls :func:`define_metrics`
so its offline folder already carries the axes (``wandb.define_metric``); the workspace layout
below is data (:data:`SECTIONS`), written next to the runs as JSON and pushed to a W&B project
with ``wandb-workspaces`` once online::

    python -m eagle3.dashboards --out runs/quickstart/wandb_dashboard.json   # the layout, offline
    wandb sync runs/quickstart/train/wandb/offline-run-*  (and mine/, eval/)
    pip install wandb-workspaces && python -m eagle3.dashboards --push --entity ME --project eagle3
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

DASHBOARD_VERSION = 1
MAX_DEPTH = 8
"""Per-position panels cover TTT steps / draft positions up to this depth."""

# (section, [(panel kind, title, x axis or None, [metrics])]); "line" panels plot y over x,
# "bar" panels compare runs' summaries, "table" panels show a logged wandb.Table.
SECTIONS: list[tuple[str, list[tuple[str, str, str | None, list[str]]]]] = [
    ("Acceptance over training", [
        ("line", "held-out tau_sim", "step", ["eval/tau_sim"]),
        ("line", "held-out acceptance per TTT step", "step", [f"eval/acc_{i}" for i in range(MAX_DEPTH)]),
        ("line", "conditional acceptance per TTT step", "step",
         [f"eval/cond_acc_{i}" for i in range(MAX_DEPTH)]),
        ("line", "loss", "step", ["train/loss", "eval/loss"]),
        ("line", "training tau_sim", "step", ["train/tau_sim"]),
        ("line", "throughput and lr", "step", ["train/tokens_per_s", "train/lr", "train/grad_norm"]),
    ]),
    ("Mining rounds", [
        ("line", "held-out tau_sim per domain after each round", "mine/round",
         [f"mine/after/domain/{d}/tau_sim" for d in ("coding", "science", "multilingual", "general")]
         + ["mine/after/all/all/tau_sim"]),
        ("line", "held-out tau_sim per domain before each round", "mine/round",
         [f"mine/before/domain/{d}/tau_sim" for d in ("coding", "science", "multilingual", "general")]),
        ("table", "hardest training samples", None, ["mine/hardest"]),
    ]),
    ("Serving", [
        ("bar", "tau per eval set", None, [f"serve/{s}/tau" for s in ("mtbench", "humaneval", "gsm8k",
                                                                        "multilingual", "overall")]),
        ("bar", "acceptance per position (overall)", None, [f"serve/overall/accept_pos{i}"
                                                             for i in range(1, MAX_DEPTH + 1)]),
        ("bar", "speedup over plain decoding", None, [f"serve/{s}/speedup" for s in ("mtbench", "humaneval",
                                                                                     "gsm8k", "multilingual",
                                                                                     "overall")]),
        ("bar", "tokens/s", None, [f"serve/{s}/tokens_per_s" for s in ("mtbench", "humaneval", "gsm8k",
                                                                       "multilingual", "overall")]),
        ("table", "per-prompt results", None, ["serve/prompts"]),
    ]),
]

_STEP = {"train": "step", "mine": "mine/round"}


def define_metrics(run: Any, kind: str) -> None:
    """Declare the x axis of a run's metrics (``kind``: train, mine or serve) and tag the run."""
    run.config.update({"eagle3_dashboard": {"version": DASHBOARD_VERSION, "kind": kind}}, allow_val_change=True)
    if kind in _STEP:
        step = _STEP[kind]
        run.define_metric(step)
        run.define_metric("*" if kind == "train" else "mine/*", step_metric=step)
        if kind == "train":
            run.define_metric("eval/tau_sim", step_metric=step, summary="max")


def spec() -> dict[str, Any]:
    """The layout as plain data."""
    return {"version": DASHBOARD_VERSION,
            "sections": [{"name": name, "panels": [{"kind": k, "title": t, "x": x, "metrics": m}
                                                  for k, t, x, m in panels]} for name, panels in SECTIONS]}


def workspace(entity: str, project: str, name: str = "eagle3 acceptance") -> Any:
    """A ``wandb_workspaces`` Workspace built from :data:`SECTIONS` (needs ``pip install wandb-workspaces``)."""
    import wandb_workspaces.reports.v2 as wr
    import wandb_workspaces.workspaces as ws

    def panel(kind: str, title: str, x: str | None, metrics: list[str]) -> Any:
        if kind == "line":
            return wr.LinePlot(title=title, x=x, y=metrics)
        if kind == "bar":
            return wr.BarPlot(title=title, metrics=metrics)
        return wr.WeavePanelSummaryTable(table_name=metrics[0])

    sections = [ws.Section(name=name, panels=[panel(*p) for p in panels], is_open=True) for name, panels in SECTIONS]
    return ws.Workspace(entity=entity, project=project, name=name, sections=sections)


def main(argv: Sequence[str] | None = None) -> int:
    from eagle3.errors import run_cli

    return run_cli("eagle3.dashboards", _main, argv)


def _main(argv: Sequence[str] | None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eagle3.dashboards", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="write the layout as JSON here")
    parser.add_argument("--push", action="store_true", help="save the workspace to W&B (online, wandb-workspaces)")
    parser.add_argument("--entity", default=None)
    parser.add_argument("--project", default="eagle3")
    args = parser.parse_args(argv)
    layout = json.dumps(spec(), indent=1)
    if args.out:
        from eagle3.atomic import atomic_write_text

        atomic_write_text(Path(args.out), layout + "\n")
    else:
        print(layout)
    if args.push:
        if not args.entity:
            from eagle3.errors import ConfigError

            raise ConfigError("--push needs --entity")
        view = workspace(args.entity, args.project)
        view.save()
        print(f"saved {view.url}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
