"""The adaptive policy's calibration (`speculative/adaptive.py`): the probability that a draft is
accepted, from the drafter's confidence in it, per mode (greedy / sampled) and draft position,
learned from every verified draft."""

from __future__ import annotations

import numpy as np


class Calibrator:
    """Acceptance probability of a draft from its confidence, per mode and draft position."""

    def __init__(self, num_positions: int, num_bins: int = 10, prior_weight: float = 4.0):
        self.num_bins = num_bins
        self.centers = (np.arange(num_bins) + 0.5) / num_bins
        shape = (2, num_positions, num_bins)
        # Beta prior: `prior_weight` pseudo-drafts at the bin's confidence (a calibrated drafter).
        self.hits = np.broadcast_to(self.centers * prior_weight, shape).copy()
        self.trials = np.full(shape, prior_weight)
        # Outcomes per position alone (a weak prior of one pass in two): a new request's estimate.
        self.position_hits, self.position_trials = np.ones((2, num_positions)), np.full((2, num_positions), 2.0)
        # The calibrated acceptance of every drafted position, verified or not, summed per mode and
        # position (`typical_means`).
        self.drafted_alpha, self.drafted = np.zeros((2, num_positions)), np.zeros((2, num_positions))

    def bins(self, confidence: np.ndarray) -> np.ndarray:
        return np.clip((np.asarray(confidence) * self.num_bins).astype(np.int64), 0, self.num_bins - 1)

    def alpha(self, modes: np.ndarray, confidence: np.ndarray) -> np.ndarray:
        """[n, P] calibrated acceptance probabilities (before any per-request offset)."""
        table = self.hits / self.trials
        positions = np.arange(confidence.shape[1])[None, :]
        return table[np.asarray(modes)[:, None], positions, self.bins(confidence)]

    def position_means(self, mode: int) -> np.ndarray:
        """[P] observed acceptance per position, whatever the confidence (a new request's
        estimate, and the no-confidence one)."""
        return self.position_hits[mode] / self.position_trials[mode]

    def typical_means(self, mode: int, min_drafts: int = 16) -> np.ndarray:
        """[P] the acceptance of a typical draft per position: the mean calibrated acceptance of
        every draft drafted there (`observe_drafted`), where at least `min_drafts` were; else the
        observed outcomes (`position_means`). The outcomes are of verified drafts only, and the
        policy verifies the confident ones, so their mean leans high for a typical request (on
        the real pair 0.59 / 0.65 / 0.86 at positions 1-3 against 0.63 / 0.55 / 0.50 for every
        drafted one, docs/adaptive.md 2026-12-04). Calibration is per confidence
        bin, so choosing by confidence does not bias the drafted positions' calibrated mean."""
        counts = self.drafted[mode]
        return np.where(counts >= min_drafts, self.drafted_alpha[mode] / np.maximum(counts, 1),
                        self.position_means(mode))

    def drafts_seen(self, mode: int) -> float:
        """Drafts read at the first position: every one drafted (`observe_drafted`, with
        confidences) or, without confidences, every one verified."""
        return max(self.drafted[mode, 0], self.position_trials[mode, 0] - 2.0)

    def observe_drafted(self, modes: np.ndarray, alpha: np.ndarray, drafted: np.ndarray) -> None:
        """alpha [n, P]: the calibrated acceptance of n requests' drafts, at the positions where
        `drafted` [n, P] is set (whether verified or not)."""
        rows, positions = np.nonzero(drafted)
        cells = (np.asarray(modes)[rows], positions)
        np.add.at(self.drafted_alpha, cells, alpha[rows, positions])
        np.add.at(self.drafted, cells, 1.0)

    def observe(self, modes: np.ndarray, confidence: np.ndarray | None, outcomes: np.ndarray,
                observed: np.ndarray) -> None:
        """Outcomes [n, P] (1 = accepted) of n requests' drafts at the positions where `observed`
        [n, P] is set, drafted in `modes` [n] with `confidence` [n, P] (None: a drafter without
        confidences; only the positions learn). One scatter for the whole batch."""
        rows, positions = np.nonzero(observed)
        modes, hits = np.asarray(modes)[rows], outcomes[rows, positions]
        if confidence is not None:
            cells = (modes, positions, self.bins(confidence[rows, positions]))
            np.add.at(self.hits, cells, hits)
            np.add.at(self.trials, cells, 1.0)
        np.add.at(self.position_hits, (modes, positions), hits)
        np.add.at(self.position_trials, (modes, positions), 1.0)
