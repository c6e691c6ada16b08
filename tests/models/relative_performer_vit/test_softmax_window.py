"""The relative-performer ViT refuses the sliding-window hybrid: its tokens form a 2D grid."""

import pytest

from tests.conftest import tiny_relative_performer_vit_config


def test_the_vit_refuses_a_window():
    with pytest.raises(ValueError, match="softmax_window=4 is not supported by the relative-performer ViT"):
        tiny_relative_performer_vit_config(softmax_window=4)
