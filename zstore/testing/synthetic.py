"""Synthetic speech-like HDF5 data in the users' layout (demo, tests, benchmark).

Each group ``utt000000`` ... holds ``wav`` (mics, samples) float32 made from 16-bit
PCM at 16 kHz -- band-limited noise under a syllable-rate amplitude envelope,
silent where no speaker talks -- and ``act`` (speakers, frames) 0/1 float32 at
100 frames/s (``frames = samples // 160``).  Item lengths vary.

``audio="float"`` makes processed audio instead: every speaker's own band-limited
source, convolved per microphone with a decaying random room response and summed, plus
sensor noise, kept in float32 with no 16-bit rounding (the values of dereverberated,
beamformed, simulated or resampled signals: their low mantissa bits are noise).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import h5py
import numpy as np

WAV_RATE = 16000
ACT_RATE = 100
HOP = WAV_RATE // ACT_RATE


@dataclass(frozen=True)
class SyntheticSpec:
    """What :func:`make_synthetic` writes."""

    items: int = 8
    mics: int = 8
    speakers: int = 3
    min_seconds: float = 15.0
    max_seconds: float = 45.0
    seed: int = 0
    #: ``"int16"``: float32 holding 16-bit PCM values (x / 32768), as read from WAV or
    #: FLAC; ``"float"``: reverberant mixtures kept in float32 (true float values)
    audio: str = "int16"
    #: items under this many speaker groups (``spk003/utt000123``); 0: at the root
    groups: int = 0

    def __post_init__(self) -> None:
        if self.audio not in AUDIO_KINDS:
            raise ValueError(f"audio={self.audio!r}: pick one of {', '.join(AUDIO_KINDS)}")


AUDIO_KINDS = ("int16", "float")
#: the room responses of ``audio="float"``: ~0.25 s long, decaying 60 dB in ~0.3 s
ROOM_TAPS, ROOM_RT60 = 4096, 0.3


def _activity(rng: np.random.Generator, speakers: int, frames: int) -> np.ndarray:
    act = np.zeros((speakers, frames), dtype=np.float32)
    for s in range(speakers):
        f = int(rng.integers(0, 200))
        while f < frames:
            talk = int(rng.integers(80, 500))
            act[s, f : f + talk] = 1.0
            f += talk + int(rng.integers(50, 400))
    return act


def _band_limited(rng: np.random.Generator, n: int) -> np.ndarray:
    spectrum = np.fft.rfft(rng.standard_normal(n).astype(np.float32))
    freqs = np.fft.rfftfreq(n, d=1.0 / WAV_RATE)
    # Speech energy sits between ~100 Hz and ~4 kHz and falls off above.
    shape = np.where(freqs < 100, 0.0, 1.0) / (1.0 + (freqs / 1500.0) ** 2)
    return np.fft.irfft(spectrum * shape, n).astype(np.float32)


def make_item(rng: np.random.Generator, spec: SyntheticSpec) -> dict[str, np.ndarray]:
    """One utterance: ``{"wav": (mics, samples), "act": (speakers, frames)}``."""
    seconds = rng.uniform(spec.min_seconds, spec.max_seconds)
    frames = max(1, int(seconds * ACT_RATE))
    samples = frames * HOP + int(rng.integers(0, HOP))
    act = _activity(rng, spec.speakers, frames)
    talking = np.repeat(act.max(axis=0), HOP)
    talking = np.pad(talking, (0, samples - talking.size))
    t = np.arange(samples, dtype=np.float32) / WAV_RATE
    syllables = 0.55 + 0.45 * np.sin(2 * np.pi * 4.0 * t + rng.uniform(0, 6.3)) ** 2
    envelope = (0.02 + 0.3 * talking * syllables).astype(np.float32)
    if spec.audio == "float":
        return {"wav": _reverberant(rng, spec, act, syllables, samples), "act": act}
    source = _band_limited(rng, samples) * envelope
    source /= max(1e-6, float(np.abs(source).max()) * 1.25)
    wav = np.empty((spec.mics, samples), dtype=np.float32)
    for m in range(spec.mics):
        delay = int(rng.integers(0, 8))
        mic = np.roll(source, delay) * rng.uniform(0.6, 1.0)
        mic += rng.standard_normal(samples).astype(np.float32) * 0.002
        pcm = np.clip(np.round(mic * 32767), -32768, 32767).astype(np.int16)
        wav[m] = pcm.astype(np.float32) / 32768.0
    return {"wav": wav, "act": act}


def _reverberant(
    rng: np.random.Generator,
    spec: SyntheticSpec,
    act: np.ndarray,
    syllables: np.ndarray,
    samples: int,
) -> np.ndarray:
    """``(mics, samples)`` true-float32 mixtures: each speaker's source through its own
    room response to each microphone, summed, with sensor noise; peak ~0.8."""
    n = samples + ROOM_TAPS
    decay = np.exp(-6.9 * np.arange(ROOM_TAPS) / (ROOM_RT60 * WAV_RATE))
    spectra = []
    for s in range(spec.speakers):
        talking = np.pad(np.repeat(act[s], HOP), (0, samples - act.shape[1] * HOP))
        source = _band_limited(rng, samples) * (0.3 * talking * syllables)
        spectra.append(np.fft.rfft(source, n))
    wav = np.empty((spec.mics, samples), dtype=np.float32)
    for m in range(spec.mics):
        mix = np.zeros(n // 2 + 1, dtype=np.complex128)
        for spectrum in spectra:
            room = rng.standard_normal(ROOM_TAPS) * decay
            room[int(rng.integers(0, 16))] += 4.0  # the direct path
            mix += spectrum * np.fft.rfft(room / np.abs(room).sum() * 8.0, n)
        wav[m] = np.fft.irfft(mix, n)[:samples]
        wav[m] += rng.standard_normal(samples) * 1e-4
    wav *= 0.8 / max(1e-6, float(np.abs(wav).max()))
    return wav


def make_synthetic(
    path: str | os.PathLike[str], spec: SyntheticSpec = SyntheticSpec(), *, progress: bool = False
) -> int:
    """Write ``spec.items`` utterances to the HDF5 file ``path``; return its size in bytes."""
    rng = np.random.default_rng(spec.seed)
    tmp = f"{os.fspath(path)}.tmp-{os.getpid()}"
    items = range(spec.items)
    if progress:
        from tqdm import tqdm

        items = tqdm(items, desc="synthetic HDF5", unit="item")
    with h5py.File(tmp, "w") as f:
        for i in items:
            name = f"utt{i:06d}"
            if spec.groups:
                name = f"spk{int(rng.integers(spec.groups)):03d}/{name}"
            group = f.create_group(name)
            for name, data in make_item(rng, spec).items():
                group.create_dataset(name, data=data)
            group.attrs["speaker_count"] = spec.speakers
    os.replace(tmp, path)
    return os.path.getsize(path)


def items_for_size(size_bytes: int, spec: SyntheticSpec) -> int:
    """How many items make about ``size_bytes`` of HDF5."""
    mean_seconds = (spec.min_seconds + spec.max_seconds) / 2
    per_item = mean_seconds * (spec.mics * WAV_RATE + spec.speakers * ACT_RATE) * 4
    return max(1, round(size_bytes / per_item))


__all__ = [
    "ACT_RATE",
    "AUDIO_KINDS",
    "HOP",
    "WAV_RATE",
    "SyntheticSpec",
    "items_for_size",
    "make_item",
    "make_synthetic",
]
