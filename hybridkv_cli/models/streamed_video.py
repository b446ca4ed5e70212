"""A video prompt whose frames are decoded while the prompt is read: an hour of video with one
chunk of frames in host memory.

The prompt's tokens are known before any frame is decoded: the processor is run on a stand-in
clip of one temporal group (2 frames at the stream's size) and its run of video tokens is
repeated once per group of the whole video (Qwen2/2.5-VL give every group ``h * w / 4`` tokens,
and the group's spacing in time, ``second_per_grid_ts``, depends only on the sampling rate). The
pixels become a :class:`FramePixels`: sliced by rows in prompt order, it decodes the frames those
rows come from and runs the video processor on them (patches of one group never depend on
another's, so the rows equal the whole clip's).
"""

from __future__ import annotations

from typing import Callable

import torch

from hybridkv_cli.media import VideoStream
from hybridkv_cli.media.geometry import FRAME_FACTOR

VIDEO_TOKEN = "<|video_pad|>"  # Qwen2/2.5-VL's video placeholder
#: Frames decoded at a time (the stream's own chunk; the prompt's chunks take what they need).
DECODE_FRAMES = 32


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
    standin = torch.zeros(FRAME_FACTOR, 3, *stream.size, dtype=torch.uint8)
    one = dict(processor(text=[text], videos=[standin], videos_kwargs=kwargs_for(FRAME_FACTOR), return_tensors="pt"))
    groups = stream.count // FRAME_FACTOR
    ids = one["input_ids"][0]
    video = (ids == processor.tokenizer.convert_tokens_to_ids(VIDEO_TOKEN)).nonzero().flatten()
    first, last = int(video[0]), int(video[-1]) + 1
    inputs = {}
    for key, value in one.items():  # every per-token tensor: the video run repeated once per group
        if torch.is_tensor(value) and value.shape == one["input_ids"].shape:
            value = torch.cat([value[:, :first], value[:, first:last].repeat(1, groups), value[:, last:]], dim=1)
        inputs[key] = value
    t, h, w = one["video_grid_thw"][0].tolist()
    inputs["video_grid_thw"] = torch.tensor([[groups * t, h, w]], dtype=one["video_grid_thw"].dtype)

    def process(frames: torch.Tensor) -> torch.Tensor:
        return processor.video_processor(videos=[frames], return_tensors="pt",
                                         **kwargs_for(frames.shape[0]))["pixel_values_videos"]

    inputs["pixel_values_videos"] = FramePixels(stream, process, rows_per_group=h * w, on_read=on_read)
    return inputs
