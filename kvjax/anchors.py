"""Deprecated: AnLLM's anchor-token helpers moved to `kvjax.anllm_anchors` ("anchors" alone also named
MAT's anchor tokens and the eq. 4 mask argument)."""

import warnings

from kvjax.anllm_anchors import *  # noqa: F403

warnings.warn("kvjax.anchors is deprecated; import kvjax.anllm_anchors", DeprecationWarning, stacklevel=2)
