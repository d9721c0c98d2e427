"""Look inside a ViT: the paper's inspection figures (Fig. 6, 7, 10, 11, 14) as functions returning arrays.

- `embedding_filter_pca`: PCA of the patch-embedding filters (Fig. 7 left).
- `posemb_similarity`: cosine similarity of position embeddings on the patch grid (Fig. 7 centre, 10).
- `mean_attention_distance` / `attention_distance`: per layer and head, in pixels (Fig. 7 right, 11).
- `attention_rollout` / `rollout_maps` / `attention_maps`: Abnar & Zuidema rollout and raw maps (Fig. 6, 14).
- `inspect_model`: all of them on a model and images, with PNGs and one HTML report.
"""

from vitlab.inspect.distance import (
    attention_distance,
    mean_attention_distance,
    patch_distances,
    uniform_attention_distance,
)
from vitlab.inspect.filters import FilterPCA, embedding_filter_pca
from vitlab.inspect.pipeline import InspectResult, check_inspectable, collect, inspect_model
from vitlab.inspect.posemb import posemb_similarity, similarity_mosaic
from vitlab.inspect.rollout import attention_maps, attention_rollout, fuse_heads, rollout_maps, token_map

__all__ = [
    "FilterPCA", "InspectResult", "attention_distance", "attention_maps", "attention_rollout",
    "check_inspectable", "collect", "embedding_filter_pca", "fuse_heads", "inspect_model",
    "mean_attention_distance", "patch_distances", "posemb_similarity", "rollout_maps",
    "similarity_mosaic", "token_map", "uniform_attention_distance",
]
