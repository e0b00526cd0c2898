"""The models of docs/models.md, each a ``parity.Case``: the six PhysicsNeMo runs domain-parallel in its repository's
``test/domain_parallel/models`` (Transolver, GeoTransolver, FLARE, DiT, sharded DoMINO, the 3-D diffusion U-Net), its
FNO and the series' U-Net. Options are each model's defaults except where a default needs a CUDA-only package
(``settings`` says which, and what it changes); sizes are small, so two CPU cores run the table in minutes.
``python -m shardlab.tools.models`` checks them on 2 and 4 ranks and writes the table.
"""

from __future__ import annotations

import torch

from . import models
from .parity import Case

POINT_MODEL = dict(n_layers=2, n_hidden=32, n_head=4, slice_num=8)  # small; every option left at its default


def _points(size: int, features: int = 3, coords: int = 2) -> dict:
    return {"fx": torch.randn(1, size, features), "embedding": torch.rand(1, size, coords)}


def _transolver():
    from physicsnemo.models.transolver import Transolver

    return Transolver(functional_dim=3, out_dim=2, embedding_dim=2, use_te=False, **POINT_MODEL)


transolver = Case(
    "Transolver", _transolver, _points, {"fx": 1, "embedding": 1},
    settings="use_te=False: the default, True, needs Transformer Engine, a CUDA-only package (`te = "
             "OptionalImport(\"transformer_engine.pytorch\")`, physicsnemo/nn/module/mlp_layers.py:29). What differs "
             "in the communication: this path all-reduces q, k and v of the slice tokens before attention among the "
             "slices (`qkv.redistribute(placements=[Replicate()])`, nn/module/physics_attention.py:454-456: "
             "B·H·S·3D values a block, 6,144 B here); the TE path (`_compute_slice_attention_te`, "
             "physics_attention.py:400-427) has no redistribute: te.Linear and te.DotProductAttention get the slice "
             "tokens as each rank's partial sums. Not run here (no TE on CPU): whether TE's kernels then reduce, "
             "gather or compute on partial sums is for a GPU run to show")


def _geotransolver():
    from physicsnemo.models.geotransolver import GeoTransolver

    return GeoTransolver(functional_dim=3, out_dim=2, geometry_dim=3, global_dim=8, **POINT_MODEL)


def _geometry_inputs(size: int) -> dict:
    # A geometry of another point count, split unevenly against the field; 4 global tokens, replicated.
    return {"local_embedding": torch.randn(1, size, 3), "geometry": torch.randn(1, size // 2 + 4, 3),
            "global_embedding": torch.randn(1, 4, 8)}


geotransolver = Case("GeoTransolver", _geotransolver, _geometry_inputs, {"local_embedding": 1, "geometry": 1},
                     settings="defaults (GALE attention, use_te=False)")


def _flare():
    from physicsnemo.models.flare import FLARE

    return FLARE(functional_dim=3, out_dim=2, embedding_dim=2, **POINT_MODEL)


flare = Case("FLARE", _flare, _points, {"fx": 1, "embedding": 1}, settings="defaults (use_te=False)")


def _dit(size: int):
    from physicsnemo.models.dit import DiT

    return DiT(input_size=(size, size), in_channels=4, patch_size=4, hidden_size=64, depth=2, num_heads=4)


dit = Case("DiT", _dit, lambda size: {"x": torch.randn(1, 4, size, size), "t": torch.rand(1)}, {"x": 2},
           # 2 rows of 4×4 patches a rank: scatter_tensor splits pixel rows, so an uneven split would cut a patch
           sizes=lambda domain: (8 * domain,), strategy="fsdp_spatial", spatial={"pos_embed": 1},
           settings="defaults (timm attention); pos_embed (1, tokens, C) split along its tokens on domain, the rest "
                    "fully_shard on ddp, as PhysicsNeMo's DiT test and the StormCast recipe do")


def _domino():
    import copy

    from physicsnemo.models.domino import DoMINO
    from physicsnemo.models.domino.config import DEFAULT_MODEL_PARAMS

    config = copy.deepcopy(DEFAULT_MODEL_PARAMS)
    config.geometry_rep.geo_processor.processor_type = "conv"
    config.interp_res = [16, 16, 16]
    return DoMINO(input_features=3, output_features_vol=5, output_features_surf=4, model_parameters=config)


_DOMINO_GLOBAL = ("volume_min_max", "surface_min_max", "global_params_reference", "global_params_values")


def _domino_inputs(size: int) -> dict:
    grid, neighbours = (1, 16, 16, 16), 7
    points = {name: torch.randn(1, size, 3) for name in (
        "pos_volume_closest", "pos_volume_center_of_mass", "pos_surface_center_of_mass", "geometry_coordinates",
        "surface_mesh_centers", "surface_normals", "volume_mesh_centers")}
    return points | {
        "grid": torch.randn(*grid, 3), "surf_grid": torch.randn(*grid, 3), "sdf_grid": torch.randn(*grid),
        "sdf_surf_grid": torch.randn(*grid), "sdf_nodes": torch.randn(1, size, 1),
        "surface_mesh_neighbors": torch.randn(1, size, neighbours, 3),
        "surface_neighbors_normals": torch.randn(1, size, neighbours, 3), "surface_areas": torch.rand(1, size),
        "surface_neighbors_areas": torch.rand(1, size, neighbours),
        **{name: torch.randn(1, 2, 3) for name in _DOMINO_GLOBAL[:2]},
        **{name: torch.randn(1, 2, 1) for name in _DOMINO_GLOBAL[2:]}}


domino = Case("DoMINO (sharded)", _domino, _domino_inputs,
              {name: 1 for name in _domino_inputs(8) if name not in _DOMINO_GLOBAL and "grid" not in name},
              one_dict=True, all_handlers=True,
              settings="conv geometry processor and a 16³ grid (PhysicsNeMo's own test takes conv for speed; default "
                       "unet, 128×64×64); the grids replicated, the points split")


def _unet3d():
    from physicsnemo.experimental.models.diffusion_unets import DiffusionUNet3D

    return DiffusionUNet3D(x_channels=2, num_levels=2, model_channels=16, channel_mult=[1, 2], num_blocks=1,
                           attention_levels=[1], dropout=0.0)


unet3d = Case("DiffusionUNet3D", _unet3d, lambda size: {"x": torch.randn(1, 2, size, 8, 8), "t": torch.rand(1)},
              {"x": 2}, sizes=lambda domain: (8 * domain,),
              settings="PhysicsNeMo's test configuration (2 levels, attention at level 1), dropout 0")


def _fno(**options):
    from physicsnemo.models.fno import FNO

    return FNO(in_channels=1, out_channels=1, dimension=2, latent_channels=8, num_fno_layers=2, num_fno_modes=4,
               decoder_layers=1, decoder_layer_size=8, **options)


def _fno_on_slabs():
    from .workarounds import fno_on_slabs

    return fno_on_slabs(models.spectral_layers_on_slabs(_fno()))


fno = Case("FNO", _fno_on_slabs, lambda size: {"x": torch.randn(1, 1, size, size)}, {"x": 2},
           sizes=lambda domain: (16 * domain, 16 * domain + 1),
           settings="defaults (padding 8, coordinate features), run on slabs: its spectral layers by "
                    "`sl.models.spectral_layers_on_slabs` (rfft2 has no ShardTensor handler: DTensor would move the "
                    "field off H), its coordinate grid and padding by `sl.workarounds.fno_on_slabs` (upstream builds "
                    "the whole (B, 2, H, W) grid on every rank, `self._meshgrid(list(x.shape), x.device)`, "
                    "nn/module/fno_layers.py:369, and drops the padding with a slice of the split dim that aborts "
                    "the ranks, line 387)")

# Not a row: FNO before the grid fix (padding 0, so upstream's unpadding never slices the split dim; the spectral
# layers on slabs): each rank builds the whole coordinate grid, which the audit finds
# (tests/multirank/test_fno_grid_and_spatial.py).
fno_grid_whole = Case("FNO, whole coordinate grid", lambda: models.spectral_layers_on_slabs(_fno(padding=0)),
                      fno.inputs, {"x": 2}, sizes=lambda domain: (16 * domain,), settings="padding 0, grid as upstream")


unet = Case("U-Net (sl.models.unet)", lambda: models.unet(width=8, levels=2),
            lambda size: {"x": torch.randn(1, 1, size, size)}, {"x": 2},
            # avg_pool2d pairs rows within a shard: every shard keeps an even row count (an uneven 2-way split has an
            # odd one; 4-way: 16, 16, 16, 14)
            sizes=lambda domain: (16 * domain,) if domain == 2 else (16 * domain, 16 * domain - 2),
            settings="width 8, levels 2 (even rows per shard at every level: no uneven split exists at 2 ranks)")

CASES = (transolver, geotransolver, flare, dit, domino, unet3d, fno, unet)

# Not a row of the table: lesson 13's FNO (padding 0), whose rfft2 along the split dim has no ShardTensor handler
# (tests/multirank/test_parity.py checks the harness names it, and where the backward stops).
fno_unpadded = Case("FNO, padding 0 (sl.models.fno)", lambda: models.fno(),
                    lambda size: {"x": torch.randn(1, 1, size, size)}, {"x": 2}, sizes=lambda domain: (8 * domain,),
                    settings="padding 0, coordinate features")

# Not a row either: Transolver laid out as fsdp_spatial (no table follows its field: FSDP2 alone, on ddp), which the
# multirank test runs on a (ddp 2, domain 2) mesh: the gradients come back as DTensor shards of FSDP2.
transolver_fsdp = Case("Transolver, fsdp_spatial", _transolver, _points, {"fx": 1, "embedding": 1},
                       strategy="fsdp_spatial", settings=transolver.settings)



# Spatial parameters, measured (docs/models.md's second table): DiT's tokenizer, the part of DiT that holds its
# positional table and the part that runs on CPU ranks (its attention is ring attention there, CUDA only:
# domain_parallel/shard_utils/attention_patches.py:201), laid out both ways on the same split of the field.
def _dit_tokenizer(size: int):
    return _dit(size).tokenizer


_TABLE = "pos_embed (1, tokens, C), the tokens in the field's row order: a rank's rows of patches are its run of tokens"
dit_replicated = Case("DiT tokenizer, pos_embed replicated", _dit_tokenizer,
                      lambda size: {"x": torch.randn(1, 4, size, size)}, {"x": 2}, sizes=dit.sizes,
                      settings=f"{_TABLE}; left a plain parameter (DDP): every rank holds it whole")
dit_sharded = Case("DiT tokenizer, pos_embed sharded", _dit_tokenizer, dit_replicated.inputs, {"x": 2},
                   sizes=dit.sizes, strategy="fsdp_spatial", spatial={"pos_embed": 1},
                   settings=f"{_TABLE}; a DTensor Shard(1) on domain, the rest fully_shard on ddp (DiT's own layout)")
SPATIAL = (dit_replicated, dit_sharded)

NAMES = {case.name: name for name, case in globals().items() if isinstance(case, Case)}  # the load() reference


def ref(case: Case) -> str:
    """The case as ``parity.load`` and the job of ranks name it."""
    return f"{__name__}:{NAMES[case.name]}"
