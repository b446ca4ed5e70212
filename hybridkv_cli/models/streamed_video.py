"""A Qwen2/2.5-VL video prompt built a temporal group at a time: its tokens from one group, its
pixels a few frames at a time.

The prompt's tokens are known before any frame is processed: the processor is run on a stand-in
clip of one temporal group (2 frames at the video's size) and its run of video tokens is
repeated once per group of the whole video (Qwen2/2.5-VL give every group ``h * w / 4`` tokens,
and the group's spacing in time, ``second_per_grid_ts``, depends only on the sampling rate). The
patches of one group never depend on another's, so the video processor run on a few frames at a
time gives the whole clip's rows:

* a video decoded while the prompt is read (an hour of video with one chunk of frames in host
  memory): the pixels are a :class:`FramePixels`, which decodes the frames a slice of rows comes
  from when the prefill reads it (:func:`streamed_video_inputs`);
* a clip already decoded: the pixels are made at once (:func:`grouped_video_inputs`).

Either way the video processor runs on :data:`GROUP_FRAMES` frames at a time, its rows written
into one tensor: its float copies of many frames (three of 141 MB for 64 frames of 364x504) are
mapped fresh from the system and faulted in on every call, where a few frames' are reused, and
the pixels come about twice as fast.
"""

from __future__ import annotations

from typing import Callable

import torch

from hybridkv_cli.media import VideoStream
from hybridkv_cli.media.geometry import FRAME_FACTOR

VIDEO_TOKEN = "<|video_pad|>"  # Qwen2/2.5-VL's video placeholder
#: Frames decoded at a time (the stream's own chunk; the prompt's chunks take what they need).
DECODE_FRAMES = 32
#: Frames the video processor is run on at a time (two temporal groups).
GROUP_FRAMES = 4


class FramePixels:
    """The ``pixel_values_videos`` of a streamed video, produced on demand in prompt order.

    ``pixels[a:b]`` decodes up to the frames that rows ``a:b`` come from and returns their rows
    (a float tensor, as the processor gives); rows must be asked for in order, each once (a
    slice from row 0 starts reading anew).
    ``on_read(frames_read, frames_total)`` is called after every decoded chunk (a progress bar).
    """

    def __init__(self, stream: VideoStream, process: Callable[[torch.Tensor], torch.Tensor], rows_per_group: int,
                 on_read: Callable[[int, int], None] | None = None):
        self.stream, self.process, self.rows_per_group = stream, process, rows_per_group
        self.on_read = on_read
        self.shape = (stream.count // FRAME_FACTOR * rows_per_group,)
        self._next_row = None  # nothing read yet

    def __getitem__(self, rows: slice) -> torch.Tensor:
        if rows.start == 0:  # (again) from the first frame: another prefill of the same prompt
            self._frames = self.stream.chunks(DECODE_FRAMES)
            self._buffer = torch.empty(0, 3, *self.stream.size, dtype=torch.uint8)
            self._next_row, self._read = 0, 0
        if rows.start != self._next_row or rows.stop <= rows.start or rows.stop % self.rows_per_group:
            raise RuntimeError(f"rows {rows.start}:{rows.stop} asked out of order (next: {self._next_row})")
        need = (rows.stop - rows.start) // self.rows_per_group * FRAME_FACTOR
        while self._buffer.shape[0] < need:
            chunk = next(self._frames)
            self._buffer = torch.cat([self._buffer, chunk])
            self._read += chunk.shape[0]
            if self.on_read is not None:
                self.on_read(self._read, self.stream.count)
        frames, self._buffer = self._buffer[:need], self._buffer[need:]
        self._next_row = rows.stop
        return self.process(frames)


def streamed_video_inputs(processor, text: str, stream: VideoStream, kwargs_for: Callable[[int], dict],
                          on_read: Callable[[int, int], None] | None = None) -> dict:
    """The processor's inputs for ``text`` (one video placeholder) about ``stream``'s frames,
    with the pixels a :class:`FramePixels` (see the module docstring); ``kwargs_for(n)`` are the
    video processor's arguments for a clip of ``n`` of its frames."""
    inputs, rows, process = _repeated_groups(processor, text, stream.count // FRAME_FACTOR, stream.size, kwargs_for)
    inputs["pixel_values_videos"] = FramePixels(stream, process, rows_per_group=rows, on_read=on_read)
    return inputs


def grouped_video_inputs(processor, text: str, video: torch.Tensor, kwargs_for: Callable[[int], dict]) -> dict:
    """What ``processor(text=[text], videos=[video], ...)`` returns for a decoded clip ``video``
    (uint8 ``(T, 3, H, W)``, ``T`` even), built a group at a time (see the module docstring)."""
    inputs, _, process = _repeated_groups(processor, text, video.shape[0] // FRAME_FACTOR, tuple(video.shape[-2:]),
                                          kwargs_for)
    inputs["pixel_values_videos"] = process(video)
    return inputs


def _repeated_groups(processor, text: str, groups: int, size: tuple[int, int], kwargs_for: Callable[[int], dict]
                     ) -> tuple[dict, int, Callable[[torch.Tensor], torch.Tensor]]:
    """The inputs of ``text`` about a video of ``groups`` temporal groups of frames of ``size``,
    but its pixels: every per-token tensor with a stand-in group's run of video tokens repeated
    once per group, and the grid; with the pixel rows of a group and ``process(frames)``, the
    pixel rows of frames (whole groups), made :data:`GROUP_FRAMES` frames at a time."""
    standin = torch.zeros(FRAME_FACTOR, 3, *size, dtype=torch.uint8)
    one = dict(processor(text=[text], videos=[standin], videos_kwargs=kwargs_for(FRAME_FACTOR), return_tensors="pt"))
    ids = one["input_ids"][0]
    video = (ids == processor.tokenizer.convert_tokens_to_ids(VIDEO_TOKEN)).nonzero().flatten()
    first, last = int(video[0]), int(video[-1]) + 1
    inputs = {}
    for key, value in one.items():  # every per-token tensor: the video run repeated once per group
        if key == "pixel_values_videos":
            continue
        if torch.is_tensor(value) and value.shape == one["input_ids"].shape:
            value = torch.cat([value[:, :first], value[:, first:last].repeat(1, groups), value[:, last:]], dim=1)
        inputs[key] = value
    t, h, w = one["video_grid_thw"][0].tolist()
    inputs["video_grid_thw"] = torch.tensor([[groups * t, h, w]], dtype=one["video_grid_thw"].dtype)

    def process(frames: torch.Tensor) -> torch.Tensor:  # the rows of whole groups, a few frames at a time
        pixels = None
        for start in range(0, frames.shape[0], GROUP_FRAMES):
            some = frames[start:start + GROUP_FRAMES]
            part = processor.video_processor(videos=[some], return_tensors="pt",
                                             **kwargs_for(some.shape[0]))["pixel_values_videos"]
            if pixels is None:
                pixels = part.new_empty((frames.shape[0] // FRAME_FACTOR * h * w, part.shape[1]))
            at = start // FRAME_FACTOR * h * w
            pixels[at:at + part.shape[0]] = part
        return pixels

    return inputs, h * w, process
