"""The on-disk format: the manifest, safetensors files (strict parsing and streaming writes), boxes,
hashes, compression, and the JSON trees and records of non-tensor state."""
