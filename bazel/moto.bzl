"""The Python packages of moto's loopback S3 server, for the tests that publish to S3."""

load("@pip//:requirements.bzl", "requirement")

MOTO = [
    requirement("boto3"),
    requirement("flask"),
    requirement("flask-cors"),
    requirement("moto"),
    requirement("werkzeug"),
]
