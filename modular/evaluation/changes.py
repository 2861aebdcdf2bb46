"""A lock report's changes from base, in words: which neighbours and far behaviours lost significantly in which
state (a verdict names them), and every change with its interval (the run's end table)."""

from __future__ import annotations

from modular.reports import LockReport, PairedChange


def paired_changes(report: LockReport, against: str = "vs_base") -> list[tuple[str, str, str, PairedChange]]:
    """(group, name, state, change) of every neighbour and far-behaviour figure that has one: from base, or with
    ``against="vs_control"`` from the run's lock-off control (the lock's own effect)."""
    out = []
    for group in ("neighbours", "others"):
        for state, row in report.states.items():
            for name, score in getattr(row, group).items():
                if getattr(score, against) is not None:
                    out.append((group, name, state, getattr(score, against)))
    return out


def significant_losses(report: LockReport) -> list[str]:
    """Each neighbour or far behaviour whose accuracy in a state fell from base's by more than its items' noise (the
    exact paired test, Holm-adjusted over its family, α = 0.05), one phrase each: ``neighbour continents open:
    significant loss -7.1 points [-12.0, -2.4] (Holm p 0.012)``."""
    out = []
    for group, name, state, vs in paired_changes(report):
        if vs.significant_loss and state != "control":  # the control's own losses are not the run's
            what = "neighbour" if group == "neighbours" else "far behaviour"
            out.append(f"{what} {name} {state}: significant loss {change_text(vs)}")
    return out


def change_text(vs: PairedChange) -> str:
    """A change from base in points with its 95% interval and Holm-adjusted p: ``-7.1 points [-12.0, -2.4] (Holm p
    0.012)`` (what a report of an earlier layout lacks is left out)."""
    text = f"{100 * (vs.gained - vs.lost) / max(vs.n, 1):+.1f} points"
    if vs.ci95 is not None:
        text += f" [{100 * vs.ci95[0]:+.1f}, {100 * vs.ci95[1]:+.1f}]"
    return text + (f" (Holm p {vs.p_holm:.2g})" if vs.p_holm is not None else f" (p {vs.p_value:.2g})")


def change_lines(report: LockReport) -> list[str]:
    """The neighbours' and far behaviours' changes from base in every state, one line each, then where measured
    their changes from the lock-off control (the run's end table):
    ``neighbour continents (204 items): open +1.0 points [-2.0, +4.0] (Holm p 1); locked ...``."""
    lines: dict[tuple[str, str, int, str], list[str]] = {}
    for against, words in (("vs_base", ""), ("vs_control", " against the lock-off control")):
        for group, name, state, vs in paired_changes(report, against):
            lines.setdefault((group, name, vs.n, words), []).append(f"{state} {change_text(vs)}")
    return [f"{'neighbour' if group == 'neighbours' else 'far behaviour'} {name}{words} ({n} items): "
            + "; ".join(parts) for (group, name, n, words), parts in lines.items()]
