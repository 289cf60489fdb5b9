"""Running nxdserve on cluster platforms: Ray Serve replicas (ray_serve.py; needs ``nxdserve[ray]``) and the
Helm chart in deploy/helm. Importing this package needs no Ray."""
