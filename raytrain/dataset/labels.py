"""The values packed sequences use for "no target" and "padding": one definition, with no imports, so the
pipeline (which must import on a bare GPU box) and the pack stage share it."""

IGNORE_INDEX = -100
"""Label value the loss ignores (torch ``cross_entropy``'s default ``ignore_index``)."""
PAD_SEGMENT_ID = -1
"""Segment id of padding tokens; real segments are numbered from 0."""
