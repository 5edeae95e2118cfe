# Unpacks the binaries of two commits (.device/old/*.xz, .device/new/*.xz, from pack.sh at each
# commit) for tools/device/ab.sh, and sets up the libraries. Source it on the device.
for f in .device/old/*.xz .device/new/*.xz; do
  python3 -c "import lzma,shutil,sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[1][:-3],'wb'))" "$f"
  chmod +x "${f%.xz}"
done
source .device/gpu-env.sh
