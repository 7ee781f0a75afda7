"""NVIDIA mixed-size vGPU mode over REST: PUT /v1/gpus/{address}/vgpu-mode, GET /v1/gpus/{address}/slots."""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter, Depends, Path

from api.auth import ADMIN_ONLY, READ, require
from api.deps import service
from api.schemas import Strict
from api.tokens import Token
from vgpumgr.service import Service

router = APIRouter(prefix="/v1")
ADDRESS = Path(min_length=7, max_length=16, pattern=r"^([0-9a-fA-F]{4}:)?[0-9a-fA-F]{2}:[0-1][0-9a-fA-F]\.[0-7]$")


class VgpuModeRequest(Strict):
    mode: Literal["mixed", "equal"]


@router.put("/gpus/{address}/vgpu-mode", tags=["gpus"])
def set_vgpu_mode(body: VgpuModeRequest, address: str = ADDRESS, svc: Service = Depends(service),
                  token: Token = Depends(require(*ADMIN_ONLY))) -> dict[str, Any]:
    """Mixed-size (heterogeneous) or equal-size vGPU mode; refused (409) while a vGPU exists on the GPU."""
    from vgpumgr.ops import vgpu_mode

    return vgpu_mode.set_mode(svc, address, body.mode, actor=token.actor)


@router.get("/gpus/{address}/slots", tags=["gpus"])
def gpu_slots(address: str = ADDRESS, svc: Service = Depends(service),
              _: Token = Depends(require(*READ))) -> dict[str, Any]:
    """The GPU's placement map and each type's creatable placement IDs (mixed-size mode)."""
    from vgpumgr.ops import slot_map

    return slot_map.slot_map(svc, address)
