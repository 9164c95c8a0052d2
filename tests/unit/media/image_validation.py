"""Images and JPEG-frame videos checked the way the gateway checks them, in one call,
outside any budget."""

from collections.abc import Sequence

from gateway.media.av import AvInfo, decode_jpeg_frames, read_jpeg_frames
from gateway.media.images import ImageInfo, ImageLimits, decode_image, read_header
from gateway.media.settings import MediaSettings


def validate_image(data: bytes, declared: str | None, settings: ImageLimits) -> ImageInfo:
    """`read_header`, then `decode_image` as deep as the settings say."""
    return decode_image(data, read_header(data, declared, settings), settings)


def validate_jpeg_frames(frames: Sequence[bytes], settings: MediaSettings) -> AvInfo:
    """A `data:video/jpeg` URL's frames: `read_jpeg_frames`, then `decode_jpeg_frames`."""
    return decode_jpeg_frames(frames, read_jpeg_frames(frames, settings), settings)
