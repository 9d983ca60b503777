//! Knowing when a connection's HTTP/2 client preface is complete, for the handshake bound.

/// Progress through the HTTP/2 client preface: 24 bytes of magic, then a SETTINGS frame (a 9-byte
/// header whose first 3 bytes are the payload length, then the payload). The bytes are not checked
/// here: the HTTP/2 server refuses a wrong preface by itself.
#[derive(Debug, Default)]
pub(super) struct Preface {
    /// Bytes read so far.
    seen: usize,
    /// The SETTINGS frame's payload length, as far as read.
    length: [u8; 3],
}

impl Preface {
    const MAGIC: usize = 24;
    const FRAME_HEADER: usize = 9;

    /// Takes in the next bytes read; whether the preface is complete.
    pub(super) fn advance(&mut self, read: &[u8]) -> bool {
        for (i, slot) in self.length.iter_mut().enumerate() {
            if let Some(b) = (Self::MAGIC + i)
                .checked_sub(self.seen)
                .and_then(|at| read.get(at))
            {
                *slot = *b;
            }
        }
        self.seen = self.seen.saturating_add(read.len());
        let [a, b, c] = self.length;
        let payload = u32::from_be_bytes([0, a, b, c]) as usize;
        self.seen >= Self::MAGIC + 3 && self.seen >= Self::MAGIC + Self::FRAME_HEADER + payload
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_preface_is_complete_after_the_magic_and_the_whole_settings_frame() {
        let magic = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
        // A SETTINGS frame with two settings (12 bytes of payload).
        let settings = [0u8, 0, 12, 4, 0, 0, 0, 0, 0];
        let mut whole = magic.to_vec();
        whole.extend_from_slice(&settings);
        whole.extend_from_slice(&[0; 12]);

        let mut at_once = Preface::default();
        assert!(at_once.advance(&whole));

        // A byte at a time: complete on the last byte of the payload, not before.
        let mut trickled = Preface::default();
        for (i, b) in whole.iter().enumerate() {
            assert_eq!(trickled.advance(&[*b]), i == whole.len() - 1, "byte {i}");
        }

        // An empty SETTINGS frame ends the preface with its header.
        let mut empty = Preface::default();
        assert!(!empty.advance(&whole[..26]));
        assert!(!empty.advance(&[0, 4, 0, 0, 0, 0]));
        assert!(empty.advance(&[0]));
    }
}
