//! Credits: permission to send one message into one posted receive slot of the peer.
//!
//! ## The reserve
//! [`CREDIT_RESERVE`] credits are kept back from data messages. Only control messages may
//! use them: [`MessageClass::Control`] (rendezvous handshakes, `Fin`) may go down to one
//! credit, and [`MessageClass::Last`] (`CreditUpdate`, `Rst`) may use the very last one.
//! This is rsocket's rationale (its design guide, "credit updates"): if data could consume
//! every credit, two peers that both filled each other's receive queues would each wait for
//! the other's credit update, which itself needs a credit: a deadlock. Keeping credits that
//! only non-data messages may use, and returning the credit of every consumed control
//! message without waiting for the application, means a credit update can always be sent.

use core::fmt;

/// Credits held back from data messages (see the module docs). Two: one for a control
/// message of the rendezvous or a `Fin`, and one for the credit update that must always be
/// possible.
pub const CREDIT_RESERVE: u16 = 2;

/// A non-negative credit count with checked arithmetic (never wraps, never goes negative).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Credits(u16);

impl Credits {
    /// No credit.
    pub const ZERO: Credits = Credits(0);

    /// `n` credits.
    pub const fn new(n: u16) -> Credits {
        Credits(n)
    }

    /// The count.
    pub const fn get(self) -> u16 {
        self.0
    }

    /// `self + n`, or `None` on overflow.
    pub fn checked_add(self, n: u16) -> Option<Credits> {
        self.0.checked_add(n).map(Credits)
    }

    /// `self - n`, or `None` if that would be negative.
    pub fn checked_sub(self, n: u16) -> Option<Credits> {
        self.0.checked_sub(n).map(Credits)
    }

    /// True when a message of `class` may be sent with these credits.
    pub const fn allows(self, class: MessageClass) -> bool {
        self.0 > class.keeps_back()
    }
}

impl fmt::Display for Credits {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} credits", self.0)
    }
}

/// Which credits a message may use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MessageClass {
    /// Application data (`Data`, `RndvRead`, `RndvWrite`): must leave the whole reserve.
    Data,
    /// Rendezvous control and `Fin`: must leave one credit for a credit update.
    Control,
    /// `CreditUpdate` and `Rst`: may use the last credit.
    Last,
}

impl MessageClass {
    /// Credits that must remain after sending a message of this class.
    pub const fn keeps_back(self) -> u16 {
        match self {
            MessageClass::Data => CREDIT_RESERVE,
            MessageClass::Control => 1,
            MessageClass::Last => 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arithmetic_is_checked() {
        assert_eq!(Credits::new(1).checked_sub(2), None);
        assert_eq!(Credits::new(u16::MAX).checked_add(1), None);
        assert_eq!(Credits::new(3).checked_sub(1), Some(Credits::new(2)));
    }

    #[test]
    fn the_reserve_is_kept_for_control_messages() {
        let at_reserve = Credits::new(CREDIT_RESERVE);
        assert!(!at_reserve.allows(MessageClass::Data));
        assert!(at_reserve.allows(MessageClass::Control));
        assert!(Credits::new(1).allows(MessageClass::Last));
        assert!(!Credits::new(1).allows(MessageClass::Control));
        assert!(!Credits::ZERO.allows(MessageClass::Last));
        assert!(Credits::new(CREDIT_RESERVE + 1).allows(MessageClass::Data));
    }
}
