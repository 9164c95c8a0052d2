"""Writes the audio and video samples in this folder with PyAV (FFmpeg's own muxers and
encoders), so the container checks are tested against real files. Not run by the tests:
the gateway's environment has no PyAV. Run it with a Python that has `av` installed,
from this folder: `python make_samples.py`."""

from __future__ import annotations

import io
from fractions import Fraction
from pathlib import Path

import av  # type: ignore[import-not-found]
import numpy as np

HERE = Path(__file__).parent


def audio(
    name: str,
    container: str,
    codec: str,
    rate: int,
    options: dict[str, str] | None = None,
    seconds: float = 0.3,
    layout: str = "mono",
    sample_format: str = "s16",
) -> None:
    out = io.BytesIO()
    with av.open(out, "w", format=container, options=options or {}) as box:
        stream = box.add_stream(codec, rate=rate, layout=layout)
        stream.format = sample_format
        stream.codec_context.options = {"strict": "experimental"}
        t = np.arange(int(rate * seconds)) / rate
        wave = np.sin(2 * np.pi * 440 * t) * 0.3
        if sample_format.startswith("s16"):
            samples = (wave * 32767).astype(np.int16)
        else:
            samples = wave.astype(np.float32)
        channels = len(av.AudioLayout(layout).channels)
        planar = sample_format.endswith("p")
        array = np.tile(samples, (channels, 1)) if planar else np.repeat(samples, channels)[None, :]
        frame = av.AudioFrame.from_ndarray(array, format=sample_format, layout=layout)
        frame.sample_rate = rate
        frame.pts = 0
        frame.time_base = Fraction(1, rate)
        for packet in stream.encode(frame):
            box.mux(packet)
        for packet in stream.encode(None):
            box.mux(packet)
    (HERE / name).write_bytes(out.getvalue())


def video(name: str, container: str, codec: str, pix_fmt: str = "yuv420p") -> None:
    out = io.BytesIO()
    with av.open(out, "w", format=container) as box:
        stream = box.add_stream(codec, rate=10)
        stream.width, stream.height, stream.pix_fmt = 32, 32, pix_fmt
        for i in range(5):
            image = np.full((32, 32, 3), (i * 40, 80, 160), dtype=np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(image, format="rgb24")):
                box.mux(packet)
        for packet in stream.encode(None):
            box.mux(packet)
    (HERE / name).write_bytes(out.getvalue())


def main() -> None:
    audio("tone.mp3", "mp3", "libmp3lame", 16000, sample_format="s16p")
    audio(
        "tone-no-id3.mp3", "mp3", "libmp3lame", 16000, {"id3v2_version": "0"}, sample_format="s16p"
    )
    audio("tone-44k-stereo.mp3", "mp3", "libmp3lame", 44100, layout="stereo", sample_format="s16p")
    audio("tone.wav", "wav", "pcm_s16le", 16000)
    audio("tone.flac", "flac", "flac", 16000)
    audio("tone.ogg", "ogg", "vorbis", 16000, layout="stereo", sample_format="fltp")
    audio("tone.opus", "ogg", "libopus", 48000)
    audio("tone.m4a", "ipod", "aac", 16000, sample_format="fltp")
    audio("tone.weba", "webm", "libopus", 48000)
    video("clip.mp4", "mp4", "libx264")
    video("clip.webm", "webm", "libvpx")
    video("clip.mkv", "matroska", "mpeg4")
    video("clip.mov", "mov", "mjpeg", "yuvj420p")


if __name__ == "__main__":
    main()
