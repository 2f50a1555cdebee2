#!/usr/bin/env bash
# Deploy the rdq stack into LocalStack with samlocal (pip install aws-sam-cli-local awscli-local).
# Needs Docker (LocalStack runs Lambda functions in containers). Usage:
#   infra/localstack/deploy.sh [postgres|redis|mongo]
set -euo pipefail
cd "$(dirname "$0")/../.."

backend="${1:-postgres}"
# Lambda containers reach the compose services through the Docker host gateway.
case "$backend" in
  postgres) url="postgresql://postgres:rdq@host.docker.internal:5432/rdq"; storage_backend=postgresql ;;
  redis)    url="redis://host.docker.internal:6379/0"; storage_backend=redis ;;
  mongo)    url="mongodb://host.docker.internal:27017/rdq"; storage_backend=mongodb ;;
  *) echo "unknown backend: $backend" >&2; exit 2 ;;
esac

export AWS_DEFAULT_REGION="${AWS_DEFAULT_REGION:-us-east-1}" AWS_ACCESS_KEY_ID=test AWS_SECRET_ACCESS_KEY=test

# Create the schema from this machine (the functions do not migrate by default).
rdq --storage "${url/host.docker.internal/127.0.0.1}" migrate

awslocal ssm put-parameter --name /rdq/storage-url --type SecureString --value "$url" --overwrite >/dev/null

samlocal build
samlocal deploy --stack-name rdq-local --resolve-s3 --capabilities CAPABILITY_IAM --no-confirm-changeset \
  --parameter-overrides StorageBackend="$storage_backend" StorageUrlParameterName=/rdq/storage-url AuthMode=API_KEY MaxWorkerConcurrency=2

api_id=$(awslocal apigateway get-rest-apis --query "items[?name=='rdq-local-api'].id" --output text)
echo "API: http://localhost:4566/restapis/${api_id}/prod/_user_request_/v1/openapi.json"
echo "API key: $(awslocal apigateway get-api-keys --include-values --query 'items[0].value' --output text)"
