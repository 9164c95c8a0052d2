"""An image checked the way the gateway checks one, outside any budget."""

from gateway.media.images import ImageInfo, ImageLimits, decode_image, read_header


def validate_image(data: bytes, declared: str | None, settings: ImageLimits) -> ImageInfo:
    """`read_header`, then `decode_image` as deep as the settings say."""
    return decode_image(data, read_header(data, declared, settings), settings)
