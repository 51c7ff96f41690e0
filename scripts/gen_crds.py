"""Write crds/<plural>.yaml from the pydantic models (`make crds`; tests/unit/test_crds.py checks they are current)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from deviceplane.api import kinds  # noqa: E402
from deviceplane.api.crd import CrdSpec, crd_yaml  # noqa: E402

MANIFEST = Path("manifests") / "10-crds.yaml"  # both CRDs, so `kubectl apply -f manifests/` installs them


def path_for(spec: CrdSpec, root: Path = ROOT) -> Path:
    return root / "crds" / f"{spec.plural}.yaml"


def manifest_text() -> str:
    return "---\n".join(crd_yaml(spec) for spec in kinds.ALL)


def main() -> int:
    for spec in kinds.ALL:
        path = path_for(spec)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(crd_yaml(spec))
        print(f"wrote {path.relative_to(ROOT)}")
    (ROOT / MANIFEST).parent.mkdir(parents=True, exist_ok=True)
    (ROOT / MANIFEST).write_text(manifest_text())
    print(f"wrote {MANIFEST}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
