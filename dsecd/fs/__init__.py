"""Images and files (docs/architecture.md, docs/pager.md).

store.py   content-addressed blob store: blobs, manifests, names published last
images.py  image builds: directories and tarballs to EROFS layers, manifests
buildcache.py  the Dockerfile build cache: step key -> the image the step made
oci.py     image archives (docker save, OCI layout; tarball or directory) and root
           file system tarballs, entries checked one by one; an index's image for this host
users.py   a user spec resolved in an image's /etc/passwd and /etc/group
erofs.py   mkfs.erofs for reproducible layers
layers.py  each layer mounted once per host, shared by every sandbox
pager.py   the FUSE pager (dsec-pager) that fetches a layer by chunks
upper.py   the writable layer: a capped tmpfs per sandbox
files.py   host-side file access inside a sandbox (openat2 RESOLVE_IN_ROOT)
copytemps.py  records of the temporary names copies make in a sandbox, for a restart to remove
"""
