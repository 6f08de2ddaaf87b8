"""The upload command over the golden library's store (goldens/artifacts)."""
