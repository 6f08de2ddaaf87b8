"""The store tests' fixtures (goldens/artifacts/fixtures.py), registered for this folder."""

from goldens.artifacts.fixtures import (  # noqa: F401
    closed_port,
    fake_aws_credentials,
    goldens,
    no_aws_config,
    s3_bucket,
    s3_endpoint,
    scratch_repo,
)
